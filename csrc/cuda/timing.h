// Timing of the CUDA engine's copies (benchmarks: tracing().cuda_timing,
// cuda_transfer_times in cuda_api.h), and the spin kernel of the fault hooks.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "device.h"

namespace ho::gpu {

// One timed copy: its events, drained by cuda_transfer_times.
struct TimedCopy {
  Lease start, end;
  uint64_t bytes;
  bool h2d;
  int device;
};
void keep_timed_copy(TimedCopy t);

// Record timing events around a copy when tracing().cuda_timing is on.
class CopyTimer {
 public:
  CopyTimer(Device& d, cudaStream_t s, uint64_t bytes, bool h2d)
      : s_(s), bytes_(bytes), h2d_(h2d), device_(d.id) {
    if (!tracing().cuda_timing.load(std::memory_order_relaxed)) return;
    start_ = d.timing->acquire();
    end_ = d.timing->acquire();
    check(cudaEventRecord(*start_, s_), "cudaEventRecord (timing)");
  }
  void done() {
    if (!start_) return;
    check(cudaEventRecord(*end_, s_), "cudaEventRecord (timing)");
    keep_timed_copy(TimedCopy{std::move(start_), std::move(end_), bytes_, h2d_, device_});
  }

 private:
  cudaStream_t s_;
  uint64_t bytes_;
  bool h2d_;
  int device_;
  Lease start_, end_;
};

// A spin kernel of `us` microseconds on `s` (fault hooks: delay_us, compute_delay_us).
void spin(int64_t us, cudaStream_t s);

}  // namespace ho::gpu
