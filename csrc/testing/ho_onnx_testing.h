/* The testing C API of the ho-onnx custom-op library: only in a testing build
 * (CMake HO_ONNX_TESTING=ON; build_info's "test_hooks" is true there), never in the shipped
 * library (its exported surface is ho_onnx_c_api.h alone).
 *
 * Fault injection for the tests (csrc/fault_hooks.h); the Python module ho_onnx._ops_testing
 * is its client (set_debug). Same conventions as ho_onnx_c_api.h.
 */
#ifndef HO_ONNX_TESTING_H_
#define HO_ONNX_TESTING_H_

#include <stdint.h>

#include "ho_onnx_c_api.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Set the fault hook `name` (all 0 by default): "delay_us", "poison", "skip_wait",
 * "skip_staging_fence", "skip_detach_wait", "skip_wait_event", "skip_store_start",
 * "compute_delay_us" (csrc/fault_hooks.h). Flags are on for value != 0; durations below 0 count as 0.
 * -1 for an unknown name. */
HO_ONNX_EXPORT int HoOnnxTest_SetFault(const char* name, int64_t value);

#ifdef __cplusplus
}
#endif

#endif /* HO_ONNX_TESTING_H_ */
