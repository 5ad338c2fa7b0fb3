#include "timing.h"

#include <mutex>
#include <utility>
#include <vector>

#include "cuda_api.h"
#include "kernels.h"

namespace ho {

namespace gpu {

namespace {
std::mutex g_times_mu;
std::vector<TimedCopy>* g_times = new std::vector<TimedCopy>();  // never freed (exit order)
CudaTransferTimes g_times_done;
}  // namespace

void keep_timed_copy(TimedCopy t) {
  std::lock_guard<std::mutex> lock(g_times_mu);
  g_times->push_back(std::move(t));
}

void spin(int64_t us, cudaStream_t s) {
  if (us > 0) check(cuda::launch_spin(us * 1000, s), "spin kernel launch (fault hook)");
}

}  // namespace gpu

using gpu::g_times;
using gpu::g_times_done;
using gpu::g_times_mu;
using gpu::TimedCopy;
using cuda::check;

CudaTransferTimes cuda_transfer_times(bool reset) {
  std::vector<TimedCopy> todo;
  {
    std::lock_guard<std::mutex> lock(g_times_mu);
    todo.swap(*g_times);
  }
  CudaTransferTimes add;
  for (TimedCopy& t : todo) {
    cuda::set_device(t.device);
    check(cudaEventSynchronize(*t.end), "cudaEventSynchronize (timing)");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, *t.start, *t.end), "cudaEventElapsedTime");
    if (t.h2d) {
      add.h2d_bytes += t.bytes;
      add.h2d_s += ms * 1e-3;
      add.h2d_copies += 1;
    } else {
      add.d2h_bytes += t.bytes;
      add.d2h_s += ms * 1e-3;
      add.d2h_copies += 1;
    }
  }
  std::lock_guard<std::mutex> lock(g_times_mu);
  g_times_done.h2d_bytes += add.h2d_bytes;
  g_times_done.h2d_s += add.h2d_s;
  g_times_done.h2d_copies += add.h2d_copies;
  g_times_done.d2h_bytes += add.d2h_bytes;
  g_times_done.d2h_s += add.d2h_s;
  g_times_done.d2h_copies += add.d2h_copies;
  CudaTransferTimes out = g_times_done;
  if (reset) g_times_done = CudaTransferTimes{};
  return out;
}

}  // namespace ho
