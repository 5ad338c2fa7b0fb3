// The experts an ORT MoE/QMoE contrib op will select (com.microsoft, CPU kernels of
// onnxruntime 1.32), computed from the same router input: a routed weight Prefetch of a
// stacked [E, ...] expert tensor moves only those experts' slices (docs/design.md, "routed").
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include <onnxruntime_c_api.h>

namespace ho {

// How the op turns a router row into its top-k.
enum class RouteMode : int {
  kNone = 0,
  // MoE: softmax over the row's E logits (float, in the kernel's order), then the k largest
  // (probability, expert) pairs, a larger expert index winning a tie.
  kSoftmax = 1,
  // QMoE: the k largest (logit, expert) pairs of the raw row, a larger index winning a tie
  // (the softmax over those k changes no choice).
  kTopK = 2,
};

// "softmax" / "topk" (the `route` attribute), kNone for anything else.
RouteMode route_mode(const char* name);

// A router input: `rows` x `experts` elements of `type` (FLOAT or FLOAT16) at `data`.
struct RouterView {
  const void* data = nullptr;
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  size_t rows = 0;
  size_t experts = 0;
};

// The union over the rows of each row's k selected experts, ascending. A row holding a NaN
// or an infinity selects every expert: the kernels' choice there is their sort's accident
// (a superset is always safe: unselected slices are never read, selected ones hold the
// weight). Refuses (Error) another element type.
std::vector<uint32_t> routed_experts(const RouterView& r, RouteMode mode, int64_t k);

}  // namespace ho
