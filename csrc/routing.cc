#include "routing.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>

#include "common.h"

namespace ho {

namespace {

// IEEE half to float, exact (as MlasConvertHalfToFloatBuffer).
float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t man = h & 0x3FFu;
  uint32_t bits = 0;
  if (exp == 0x1Fu) {
    bits = sign | 0x7F800000u | (man << 13);  // inf / NaN
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man != 0) {  // subnormal: normalise
    exp = 113;
    while ((man & 0x400u) == 0) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3FFu) << 13);
  } else {
    bits = sign;
  }
  float f = 0.0f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

void row_floats(const RouterView& r, size_t row, std::vector<float>* out) {
  out->resize(r.experts);
  if (r.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) {
    std::memcpy(out->data(), static_cast<const float*>(r.data) + row * r.experts,
                r.experts * sizeof(float));
    return;
  }
  const auto* h = static_cast<const uint16_t*>(r.data) + row * r.experts;
  for (size_t j = 0; j < r.experts; ++j) (*out)[j] = half_to_float(h[j]);
}

// The MoE kernel's softmax, operation for operation (ties it rounds to stay ties).
void softmax_in_place(std::vector<float>* v) {
  float max_logit = (*v)[0];
  for (size_t j = 1; j < v->size(); ++j) max_logit = std::max(max_logit, (*v)[j]);
  float sum_exp = 0.0f;
  for (float& x : *v) {
    x = std::exp(x - max_logit);
    sum_exp += x;
  }
  for (float& x : *v) x /= sum_exp;
}

}  // namespace

RouteMode route_mode(const char* name) {
  if (std::strcmp(name, "softmax") == 0) return RouteMode::kSoftmax;
  if (std::strcmp(name, "topk") == 0) return RouteMode::kTopK;
  return RouteMode::kNone;
}

std::vector<uint32_t> routed_experts(const RouterView& r, RouteMode mode, int64_t k) {
  if (r.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT &&
      r.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16) {
    fail(ORT_INVALID_ARGUMENT, "the router input has element type " +
                                   std::to_string(static_cast<int>(r.type)) +
                                   "; a routed transfer reads float or float16");
  }
  std::vector<char> chosen(r.experts, 0);
  if (r.experts == 0 || k <= 0) return {};
  const size_t top = std::min(static_cast<size_t>(k), r.experts);
  std::vector<float> row;
  std::vector<std::pair<float, uint32_t>> pairs(r.experts);
  for (size_t i = 0; i < r.rows; ++i) {
    row_floats(r, i, &row);
    if (!std::all_of(row.begin(), row.end(), [](float x) { return std::isfinite(x); })) {
      std::fill(chosen.begin(), chosen.end(), 1);
      break;
    }
    if (mode == RouteMode::kSoftmax) softmax_in_place(&row);
    for (size_t j = 0; j < r.experts; ++j) pairs[j] = {row[j], static_cast<uint32_t>(j)};
    std::partial_sort(pairs.begin(), pairs.begin() + static_cast<std::ptrdiff_t>(top),
                      pairs.end(), std::greater<>());
    for (size_t j = 0; j < top; ++j) chosen[pairs[j].second] = 1;
  }
  std::vector<uint32_t> out;
  for (size_t j = 0; j < r.experts; ++j) {
    if (chosen[j]) out.push_back(static_cast<uint32_t>(j));
  }
  return out;
}

}  // namespace ho
