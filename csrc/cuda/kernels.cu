#include "kernels.h"

namespace ho {
namespace cuda {

namespace {

__global__ void write_token_kernel(uint64_t* dst, uint64_t id, uint64_t magic) {
  dst[0] = id;
  dst[1] = magic;
}

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void spin_kernel(int64_t ns) {
  const uint64_t end = global_ns() + static_cast<uint64_t>(ns);
  while (global_ns() < end) __nanosleep(1000);
}

}  // namespace

cudaError_t launch_write_token(void* dst, uint64_t id, uint64_t magic, cudaStream_t stream) {
  write_token_kernel<<<1, 1, 0, stream>>>(static_cast<uint64_t*>(dst), id, magic);
  return cudaGetLastError();
}

cudaError_t launch_spin(int64_t ns, cudaStream_t stream) {
  if (ns <= 0) return cudaSuccess;
  spin_kernel<<<1, 1, 0, stream>>>(ns);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace ho
