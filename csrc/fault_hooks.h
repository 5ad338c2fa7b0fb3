// Fault injection for the tests: hooks that delay, poison or drop one ordering edge of a
// transfer, so that a test sees the failure each edge prevents (docs/cuda.md, "The hazards").
//
// They exist only in a testing build of the library (CMake HO_ONNX_TESTING=ON, which editable
// installs, scripts/test_native.sh and scripts/gpu_run.sh use: HO_ONNX_TEST_HOOKS=1, the
// table in csrc/testing/fault_hooks.cc, set through HoOnnxTest_SetFault of
// csrc/testing/ho_onnx_testing.h). In the shipped library every hook is the constant 0: the
// code each one guards folds away and no switch is left to set.
#pragma once

#include <cstdint>

#ifndef HO_ONNX_TEST_HOOKS
#define HO_ONNX_TEST_HOOKS 0
#endif

#if HO_ONNX_TEST_HOOKS
#include <atomic>
#endif

namespace ho::faults {

// Every hook, 0 unless a test sets it:
//  delay_us: sleep (CPU) / spin on the copy stream (CUDA) before every transfer;
//  poison: fill Prefetch outputs (and on CUDA the staging buffers after use) with 0xFF;
//  skip_wait: CPU: the Wait neither waits nor copies; CUDA: same as skip_wait_event.
// CUDA engine only, one per ordering edge (docs/cuda.md, "The hazards"):
//  skip_staging_fence (a): a load does not wait for its staging buffer's fence;
//  skip_detach_wait   (b): Detach does not make the compute stream wait for the store;
//  skip_wait_event    (c): Wait copies staging -> z without waiting for the load;
//  skip_store_start   (d): a Store's copy does not wait for the compute stream (x written);
//  compute_delay_us: a spin kernel on the compute stream at every Prefetch (before the
//  poison memset) and at every Wait (before its copy out of staging).
enum class Hook : int {
  kDelayUs,
  kPoison,
  kSkipWait,
  kSkipStagingFence,
  kSkipDetachWait,
  kSkipWaitEvent,
  kSkipStoreStart,
  kComputeDelayUs,
  kCount
};

#if HO_ONNX_TEST_HOOKS
// The hooks' values, indexed by Hook (csrc/testing/fault_hooks.cc).
std::atomic<int64_t>* hook_table();
inline int64_t get(Hook h) {
  return hook_table()[static_cast<int>(h)].load(std::memory_order_relaxed);
}
#else
inline int64_t get(Hook) { return 0; }
#endif

// A duration hook's value (below 0 counts as 0).
inline int64_t duration(Hook h) {
  const int64_t v = get(h);
  return v > 0 ? v : 0;
}

inline int64_t delay_us() { return duration(Hook::kDelayUs); }
inline bool poison() { return get(Hook::kPoison) != 0; }
inline bool skip_wait() { return get(Hook::kSkipWait) != 0; }
inline bool skip_staging_fence() { return get(Hook::kSkipStagingFence) != 0; }
inline bool skip_detach_wait() { return get(Hook::kSkipDetachWait) != 0; }
inline bool skip_wait_event() { return get(Hook::kSkipWaitEvent) != 0; }
inline bool skip_store_start() { return get(Hook::kSkipStoreStart) != 0; }
inline int64_t compute_delay_us() { return duration(Hook::kComputeDelayUs); }

}  // namespace ho::faults
