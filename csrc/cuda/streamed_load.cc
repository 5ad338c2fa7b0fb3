#include "streamed_load.h"

#include "timing.h"

namespace ho::gpu {

void read_chunk(Device& d, const WeightSource& w, uint64_t p, uint64_t q, char* dst,
                int64_t delay_us) {
  cuda::set_device(d.id);  // an I/O thread: every CUDA call below is on d's device
  Staging& staging = d.need_staging();
  Staging::Buf* b = staging.acquire();
  struct Back {
    Staging& s;
    Staging::Buf* b;
    ~Back() { s.release(b); }
  } back{staging, b};
  const size_t n = static_cast<size_t>(q - p);
  w.read(p, n, b->mem->data());
  counters().bytes_loaded += n;
  spin(delay_us, d.h2d.get());
  CopyTimer timer(d, d.h2d.get(), n, true);
  check(cudaMemcpyAsync(dst, b->mem->data(), n, cudaMemcpyHostToDevice, d.h2d.get()),
        "cudaMemcpyAsync (disk chunk, host to device)");
  counters().cuda_bytes_h2d += n;
  timer.done();
  check(cudaEventRecord(b->ev, d.h2d.get()), "cudaEventRecord (staging)");
  b->recorded = true;
}

}  // namespace ho::gpu
