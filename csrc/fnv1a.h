// FNV-1a 64, the hash of the data-file fingerprint (docs/design.md, "Weight locations").
// Header-only: the custom-op library verifies fingerprints with it (weight_file.cc) and the
// Python module hashes with it when the rewriter stamps them (ho_onnx.graph.fingerprint).
#pragma once

#include <cstddef>
#include <cstdint>

namespace ho {

constexpr uint64_t kFnv1aOffset = 0xcbf29ce484222325ULL;
constexpr uint64_t kFnv1aPrime = 0x100000001b3ULL;

// The FNV-1a 64 state after feeding n bytes at p to state h.
inline uint64_t fnv1a64(uint64_t h, const unsigned char* p, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= kFnv1aPrime;
  }
  return h;
}

}  // namespace ho
