// CUDA seam: functions of csrc/cuda/*.cu, present when HO_ONNX_WITH_CUDA=1.
#pragma once

#include <string>

// Number of CUDA devices; 0 with *err set when the runtime reports an error (no driver,
// no device). Never throws.
int ho_cuda_device_count(std::string* err);
