// The library's own device code (kernels.cu): launches on a given stream, errors returned.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace ho {
namespace cuda {

// Writes the 16-byte Store token {id, magic} at `dst` (device memory) on `stream`. A kernel
// argument, not a host buffer, carries the bytes: nothing on the host must outlive the
// launch, and no pageable memcpy can make the host wait.
cudaError_t launch_write_token(void* dst, uint64_t id, uint64_t magic, cudaStream_t stream);

// Keeps `stream` busy for about `ns` nanoseconds (test hooks: a slow copy, a slow compute
// stream).
cudaError_t launch_spin(int64_t ns, cudaStream_t stream);

}  // namespace cuda
}  // namespace ho
