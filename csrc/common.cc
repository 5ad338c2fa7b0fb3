#include "common.h"

#include <pthread.h>

#include <limits>

namespace ho {

namespace {
// Every fixed-size ONNX type that onnxruntime 1.31 accepts for a custom op's input/output.
// COMPLEX64 and COMPLEX128 are left out: session creation fails with "tensor type 14 (15)
// is not supported" when any op of the library declares them, which breaks every session.
const ElemType kTypes[] = {
    {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, "float", 32},
    {ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8, "uint8", 8},
    {ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8, "int8", 8},
    {ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT16, "uint16", 16},
    {ONNX_TENSOR_ELEMENT_DATA_TYPE_INT16, "int16", 16},
    {ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32, "int32", 32},
    {ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64, "int64", 64},
    {ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL, "bool", 8},
    {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16, "float16", 16},
    {ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE, "double", 64},
    {ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT32, "uint32", 32},
    {ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT64, "uint64", 64},
    {ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16, "bfloat16", 16},
    {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT8E4M3FN, "float8e4m3fn", 8},
    {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT8E4M3FNUZ, "float8e4m3fnuz", 8},
    {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT8E5M2, "float8e5m2", 8},
    {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT8E5M2FNUZ, "float8e5m2fnuz", 8},
    {ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT4, "uint4", 4},
    {ONNX_TENSOR_ELEMENT_DATA_TYPE_INT4, "int4", 4},
    // FLOAT4E2M1 (ONNX type 23) is newer than the 1.21 header; onnxruntime 1.31 accepts it.
    {static_cast<ONNXTensorElementDataType>(23), "float4e2m1", 4},
    {ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED, nullptr, 0},
};
}  // namespace

const ElemType* elem_types() { return kTypes; }

int elem_bits(ONNXTensorElementDataType t) {
  for (const ElemType* e = kTypes; e->bits != 0; ++e) {
    if (e->type == t) return e->bits;
  }
  return 0;
}

size_t byte_size(uint64_t numel, int bits) {
  const uint64_t b = static_cast<uint64_t>(bits);
  if (b != 0 && numel > (std::numeric_limits<uint64_t>::max() - 7) / b) {
    fail(ORT_INVALID_ARGUMENT, "tensor byte size overflows");
  }
  return static_cast<size_t>((numel * b + 7) / 8);
}

Counters& counters() {
  static Counters c;
  return c;
}

Tracing& tracing() {
  static Tracing t;
  return t;
}

namespace {

std::atomic<uint64_t> g_fork_generation{0};

void on_fork_child() { g_fork_generation.fetch_add(1, std::memory_order_relaxed); }

// Registered when the library is loaded (glibc unregisters it when the library is
// unloaded: pthread_atfork records the registering object's __dso_handle).
[[maybe_unused]] const int g_atfork = pthread_atfork(nullptr, nullptr, on_fork_child);

}  // namespace

uint64_t fork_generation() {
  return g_fork_generation.load(std::memory_order_relaxed);
}

}  // namespace ho
