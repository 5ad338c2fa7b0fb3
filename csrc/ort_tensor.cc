// ORT value, attribute and token helpers of ort_tensor.h.
#include "ort_tensor.h"

#include <cstring>
#include <memory>
#include <utility>

#include "common.h"

namespace ho {

void check(const OrtApi* api, OrtStatus* st) {
  if (st == nullptr) return;
  const OrtErrorCode code = api->GetErrorCode(st);
  std::string msg = api->GetErrorMessage(st);
  api->ReleaseStatus(st);
  throw Error(code, msg);
}

TensorInfo tensor_info(const OrtApi* api, const OrtValue* v) {
  OrtTensorTypeAndShapeInfo* raw = nullptr;
  check(api, api->GetTensorTypeAndShape(v, &raw));
  std::unique_ptr<OrtTensorTypeAndShapeInfo, void (*)(OrtTensorTypeAndShapeInfo*)> info(
      raw, api->ReleaseTensorTypeAndShapeInfo);
  TensorInfo out;
  size_t n = 0;
  check(api, api->GetDimensionsCount(info.get(), &n));
  out.dims.resize(n);
  if (n != 0) check(api, api->GetDimensions(info.get(), out.dims.data(), n));
  check(api, api->GetTensorShapeElementCount(info.get(), &out.numel));
  check(api, api->GetTensorElementType(info.get(), &out.type));
  return out;
}

void* tensor_data(const OrtApi* api, const OrtValue* v) {
  void* p = nullptr;
  check(api, api->GetTensorMutableData(const_cast<OrtValue*>(v), &p));
  return p;
}

const OrtValue* input(const OrtApi* api, OrtKernelContext* ctx, size_t i) {
  const OrtValue* v = nullptr;
  check(api, api->KernelContext_GetInput(ctx, i, &v));
  if (v == nullptr) fail(ORT_INVALID_ARGUMENT, "missing input " + std::to_string(i));
  return v;
}

OrtValue* output(const OrtApi* api, OrtKernelContext* ctx, const std::vector<int64_t>& dims) {
  OrtValue* v = nullptr;
  check(api, api->KernelContext_GetOutput(ctx, 0, dims.data(), dims.size(), &v));
  return v;
}

// Prefetch's optional second output `issued` (docs/design.md, op contract): an empty [0]
// tensor of T, produced once the transfer was issued and only when the node declares it. A
// later Prefetch of the same channel takes it as an ordering input (FIFO issue order)
// without keeping `y`, a full-size buffer, alive. On the CUDA EP it is a device tensor
// (nothing is written: zero bytes), so its consumers stay on the CUDA EP.
void produce_issued(const OrtApi* api, OrtKernelContext* ctx) {
  size_t n = 0;
  check(api, api->KernelContext_GetOutputCount(ctx, &n));
  if (n < 2) return;
  const int64_t dims[1] = {0};
  OrtValue* v = nullptr;  // null when the node names no second output ("")
  check(api, api->KernelContext_GetOutput(ctx, 1, dims, 1, &v));
}

bool attr_string(const OrtApi* api, const OrtKernelInfo* info, const char* name,
                 std::string* out) {
  size_t size = 0;
  OrtStatus* st = api->KernelInfoGetAttribute_string(info, name, nullptr, &size);
  if (st != nullptr) {
    api->ReleaseStatus(st);
    return false;
  }
  std::string s(size, '\0');
  check(api, api->KernelInfoGetAttribute_string(info, name, s.data(), &size));
  s.resize(std::strlen(s.c_str()));
  *out = std::move(s);
  return true;
}

bool attr_int(const OrtApi* api, const OrtKernelInfo* info, const char* name, int64_t* out) {
  OrtStatus* st = api->KernelInfoGetAttribute_int64(info, name, out);
  if (st != nullptr) {
    api->ReleaseStatus(st);
    return false;
  }
  return true;
}

bool attr_ints(const OrtApi* api, const OrtKernelInfo* info, const char* name,
               std::vector<int64_t>* out) {
  size_t size = 0;
  OrtStatus* st = api->KernelInfoGetAttributeArray_int64(info, name, nullptr, &size);
  if (st != nullptr) {
    api->ReleaseStatus(st);
    return false;
  }
  out->assign(size, 0);
  if (size != 0) check(api, api->KernelInfoGetAttributeArray_int64(info, name, out->data(), &size));
  return true;
}

std::string node_name(const OrtApi* api, const OrtKernelInfo* info) {
  size_t size = 0;
  OrtStatus* st = api->KernelInfo_GetNodeName(info, nullptr, &size);
  if (st != nullptr) {
    api->ReleaseStatus(st);
    return {};
  }
  std::string node(size, '\0');
  st = api->KernelInfo_GetNodeName(info, node.data(), &size);
  if (st != nullptr) {
    api->ReleaseStatus(st);
    return {};
  }
  node.resize(std::strlen(node.c_str()));
  return node;
}

int kernel_device(const OrtApi* api, const OrtKernelInfo* info) {
  OrtAllocator* alloc = nullptr;
  check(api, api->KernelInfoGetAllocator(info, OrtMemTypeDefault, &alloc));
  std::unique_ptr<OrtAllocator, void (*)(OrtAllocator*)> owned(alloc, api->ReleaseAllocator);
  const OrtMemoryInfo* mi = nullptr;
  check(api, api->AllocatorGetInfo(alloc, &mi));
  int id = 0;
  check(api, api->MemoryInfoGetId(mi, &id));
  return id;
}

namespace {

void check_token_size(const OrtApi* api, const OrtValue* v, int bits) {
  if (byte_size(tensor_info(api, v).numel, bits) != kTokenBytes) {
    fail(ORT_INVALID_ARGUMENT, "token input is not a 16-byte Store token");
  }
}

}  // namespace

// A token holds [id, tag] (StoreKey): 16 bytes whatever its element type.
StoreKey read_token(const OrtApi* api, const OrtValue* v, int bits) {
  check_token_size(api, v, bits);
  StoreKey t{};
  std::memcpy(&t.id, tensor_data(api, v), sizeof(t.id));
  std::memcpy(&t.tag, static_cast<const char*>(tensor_data(api, v)) + 8, sizeof(t.tag));
  return t;
}

// GPU EP: no kernel reads device memory on the host. Tokens are named by their device
// address; the engine writes tokens and does the un-aliased output copies on the stream.
StoreKey token_address(const OrtApi* api, const OrtValue* v, int bits) {
  check_token_size(api, v, bits);
  StoreKey key;
  key.id = reinterpret_cast<uintptr_t>(tensor_data(api, v));
  return key;
}

void write_token(void* dst, const StoreKey& k) {
  std::memcpy(dst, &k.id, sizeof(k.id));
  std::memcpy(static_cast<char*>(dst) + 8, &k.tag, sizeof(k.tag));
}

}  // namespace ho
