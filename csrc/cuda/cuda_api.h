// What the rest of the library (kernel.cc, registration.cc, module.cc) uses of the CUDA part, without CUDA
// types. Declared only when HO_ONNX_WITH_CUDA=1.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "../engine.h"

namespace ho {

// The CUDA-EP engine of one registration (streams and event pools per device, created by
// Engine::prepare_device at session creation). Throws ho::Error when CUDA is unusable.
std::shared_ptr<Engine> make_cuda_engine();

// cudaSetDevice(device) on the calling thread (every entry point that uses a device calls
// it: ORT's threads may have another device current). Throws ho::Error.
void cuda_set_device(int device);

// Copy `bytes` device bytes on `stream` (a kernel's compute stream).
void cuda_copy_device(void* dst, const void* src, size_t bytes, void* stream);

struct CudaMemInfo {
  size_t free_bytes = 0;
  size_t total_bytes = 0;
};
// cudaMemGetInfo of `device` (all allocations on the device, ORT's included). Throws.
CudaMemInfo cuda_mem_info(int device);

struct CudaCalibration {
  double h2d_bw = 0;  // bytes/s, best of `repeats` single cudaMemcpyAsync from pinned memory
  double d2h_bw = 0;
  size_t bytes = 0;
  int device = 0;
  std::string device_name;
};
// Pinned <-> device copy rates of `bytes` per copy. Throws.
CudaCalibration cuda_calibrate(size_t bytes, int device, int repeats);

// Time spent by the engine's copies while tracing().cuda_timing is on (timing events around
// every cudaMemcpyAsync of a transfer; drained, i.e. waited for, by this call).
struct CudaTransferTimes {
  uint64_t h2d_bytes = 0;
  double h2d_s = 0;
  uint64_t h2d_copies = 0;
  uint64_t d2h_bytes = 0;
  double d2h_s = 0;
  uint64_t d2h_copies = 0;
};
CudaTransferTimes cuda_transfer_times(bool reset);

// `bytes` of page-aligned, zero-filled host memory pinned with cudaHostRegister (portable to
// every device; counted in counters().pinned_bytes), at *data; freed with the returned holder.
// Throws when CUDA cannot pin it (no device, no driver, the pinned limit).
std::shared_ptr<void> cuda_pinned_host(size_t bytes, void** data);

}  // namespace ho
