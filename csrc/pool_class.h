// The host pool's size classes (host_memory.h), header-only so that the Python test module
// checks the very function the library uses.
#pragma once

#include <climits>
#include <cstddef>
#include <cstdint>

namespace ho {

// The size class of a request of `size` bytes: a multiple of 64, and above 512 bytes the
// next multiple of an eighth of the largest power of two not above `size` (at most 12.5%
// more than asked). The pool hands out buffers of this size.
inline size_t pool_size_class(size_t size) {
  if (size <= 512) return (size + 63) / 64 * 64;
  const size_t top = size_t{1} << (63 - __builtin_clzll(static_cast<unsigned long long>(size)));
  const size_t step = top / 8;
  if (size > SIZE_MAX - step) return size;  // (no class: a request that cannot be served)
  return (size + step - 1) / step * step;
}

}  // namespace ho
