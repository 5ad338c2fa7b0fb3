#include <cuda_runtime.h>

#include "probe.h"

int ho_cuda_device_count(std::string* err) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    if (err != nullptr) *err = cudaGetErrorString(e);
    (void)cudaGetLastError();  // do not leave the error for a later CUDA call
    return 0;
  }
  return n;
}
