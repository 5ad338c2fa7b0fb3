// Small helpers over ORT's C API for kernels: values, attributes, the kernel's node and
// device, and the Store token (every failing call becomes an ho::Error).
#pragma once

#include <onnxruntime_c_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "engine.h"

namespace ho {

// Throws the status (and releases it) when it is not null.
void check(const OrtApi* api, OrtStatus* st);

struct TensorInfo {
  std::vector<int64_t> dims;
  size_t numel = 0;
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
};

TensorInfo tensor_info(const OrtApi* api, const OrtValue* v);
void* tensor_data(const OrtApi* api, const OrtValue* v);
// Input `i` of the kernel (refused when absent) and its output 0 of shape `dims`.
const OrtValue* input(const OrtApi* api, OrtKernelContext* ctx, size_t i);
OrtValue* output(const OrtApi* api, OrtKernelContext* ctx, const std::vector<int64_t>& dims);
// Prefetch's optional second output `issued`, when the node declares it.
void produce_issued(const OrtApi* api, OrtKernelContext* ctx);

// Attributes of the kernel's node: false when the attribute is absent.
bool attr_string(const OrtApi* api, const OrtKernelInfo* info, const char* name,
                 std::string* out);
bool attr_int(const OrtApi* api, const OrtKernelInfo* info, const char* name, int64_t* out);
bool attr_ints(const OrtApi* api, const OrtKernelInfo* info, const char* name,
               std::vector<int64_t>* out);

// The kernel's node name, "" when ORT has none (never fails: it only names messages).
std::string node_name(const OrtApi* api, const OrtKernelInfo* info);
// The device of a CUDA-EP kernel: the id of its default allocator's memory info.
int kernel_device(const OrtApi* api, const OrtKernelInfo* info);

// The store a token input names. On the CPU EP the token is read ([id, tag], 16 bytes);
// on the CUDA EP it lives in device memory and is named by its device address instead.
StoreKey read_token(const OrtApi* api, const OrtValue* v, int bits);
StoreKey token_address(const OrtApi* api, const OrtValue* v, int bits);
// Writes `k` into a host token.
void write_token(void* dst, const StoreKey& k);

}  // namespace ho
