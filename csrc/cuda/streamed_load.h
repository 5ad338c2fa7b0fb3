// Streamed loads of the CUDA engine (tiers.h: the disk tier): a transfer split into chunks
// that the I/O threads read into pinned staging and copy to the device staging on the load
// stream; its completion is recorded once every chunk's copy is enqueued.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <utility>

#include "../tiers.h"
#include "device.h"
#include "records.h"

namespace ho::gpu {

// One streamed load split into chunks; the part that finishes last records `done`.
class StreamedTransfer {
 public:
  StreamedTransfer(Pending p, size_t parts, Device* dev)
      : p_(std::move(p)), remaining_(parts), dev_(dev) {}
  ~StreamedTransfer() {
    if (remaining_ != 0 && error_.empty()) error_ = "disk channel: transfer cancelled";
    if (!finished_) p_.issued->finish(std::move(error_));
  }
  StreamedTransfer(const StreamedTransfer&) = delete;
  StreamedTransfer& operator=(const StreamedTransfer&) = delete;

  bool stop() {
    std::lock_guard<std::mutex> lock(mu_);
    return !error_.empty() || p_.cancelled->load();
  }
  // Called after the part's copy was enqueued (or failed).
  void part_done(std::string error) {
    std::lock_guard<std::mutex> lock(mu_);
    if (error_.empty() && !error.empty()) error_ = std::move(error);
    if (--remaining_ != 0) return;
    // Every copy of this transfer is enqueued: `done` follows them on the h2d stream.
    cudaError_t e = cudaSetDevice(dev_->id);
    if (e == cudaSuccess) e = cudaEventRecord(*p_.done, dev_->h2d.get());
    if (e != cudaSuccess && error_.empty()) {
      error_ = std::string("CUDA error in cudaEventRecord (disk load): ") + cudaGetErrorString(e);
      (void)cudaGetLastError();
    }
    // The staging buffer's fence until a Wait copies out of it (then: that copy's event).
    if (p_.stage) p_.stage->fence = p_.done;
    finished_ = true;
    p_.issued->finish(error_);
  }

 private:
  Pending p_;
  std::mutex mu_;
  std::string error_;
  size_t remaining_;
  bool finished_ = false;
  Device* dev_;
};

// One chunk [p, q) of `w`, on an I/O thread: source -> pinned staging -> `dst` (device
// staging) on d's load stream, after a spin of `delay_us` (fault hook).
void read_chunk(Device& d, const WeightSource& w, uint64_t p, uint64_t q, char* dst,
                int64_t delay_us);

}  // namespace ho::gpu
