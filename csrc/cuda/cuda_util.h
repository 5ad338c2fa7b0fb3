// RAII and error checking over the CUDA runtime for the engine: every call goes through
// cuda_check(), which turns a failure into an ho::Error (an ORT status at the ABI boundary,
// with the op and node name added by registration.cc) carrying the CUDA error's name and text.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "../common.h"

namespace ho {
namespace cuda {

// Throws ho::Error(ORT_FAIL, "CUDA error in <what>: <name>: <text>") unless e == cudaSuccess.
void check(cudaError_t e, const char* what);
// Destructors: report nothing, never throw.
inline void ignore(cudaError_t) noexcept {}

// Makes `device` current on the calling thread (our cudart's per-thread state, not ORT's).
void set_device(int device);

// A non-blocking stream of one device.
class Stream {
 public:
  explicit Stream(int device);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

// Page-aligned host memory pinned with cudaHostRegister (portable to every device): exact
// page-rounded size, no hidden rounding to huge pages; a block of at least kHugePage starts
// on a huge-page boundary with MADV_HUGEPAGE (fewer pages to pin and map where the kernel
// has transparent huge pages). Counted in counters().pinned_bytes.
class PinnedBlock {
 public:
  static constexpr size_t kHugePage = size_t{2} << 20;
  explicit PinnedBlock(size_t bytes);
  ~PinnedBlock();
  PinnedBlock(const PinnedBlock&) = delete;
  PinnedBlock& operator=(const PinnedBlock&) = delete;
  char* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  char* data_ = nullptr;
  size_t size_ = 0;  // mapped (page-rounded) bytes
  bool registered_ = false;
};

// cudaMalloc'd device memory (calibration only; the engine's device memory is ORT's).
class DeviceBuffer {
 public:
  DeviceBuffer(int device, size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* data() const { return p_; }

 private:
  void* p_ = nullptr;
};

// Timing-enabled event (calibration).
class TimingEvent {
 public:
  TimingEvent();
  ~TimingEvent();
  TimingEvent(const TimingEvent&) = delete;
  TimingEvent& operator=(const TimingEvent&) = delete;
  cudaEvent_t get() const { return e_; }

 private:
  cudaEvent_t e_ = nullptr;
};

}  // namespace cuda
}  // namespace ho
