// The fault hooks' table (csrc/fault_hooks.h) and the testing C API that sets it
// (ho_onnx_testing.h): compiled into the library only in a testing build.
#include <atomic>
#include <cstring>
#include <string>

#include "../c_api_error.h"
#include "../fault_hooks.h"
#include "ho_onnx_testing.h"

#if !HO_ONNX_TEST_HOOKS
#error "csrc/testing/fault_hooks.cc is built only with HO_ONNX_TEST_HOOKS=1 (HO_ONNX_TESTING=ON)"
#endif

namespace ho::faults {

std::atomic<int64_t>* hook_table() {
  static std::atomic<int64_t> table[static_cast<int>(Hook::kCount)] = {};
  return table;
}

}  // namespace ho::faults

namespace {

struct HookName {
  const char* name;
  ho::faults::Hook hook;
};
using ho::faults::Hook;
const HookName kHooks[] = {
    {"delay_us", Hook::kDelayUs},
    {"poison", Hook::kPoison},
    {"skip_wait", Hook::kSkipWait},
    {"skip_staging_fence", Hook::kSkipStagingFence},
    {"skip_detach_wait", Hook::kSkipDetachWait},
    {"skip_wait_event", Hook::kSkipWaitEvent},
    {"skip_store_start", Hook::kSkipStoreStart},
    {"compute_delay_us", Hook::kComputeDelayUs},
};
static_assert(sizeof(kHooks) / sizeof(kHooks[0]) == static_cast<size_t>(Hook::kCount),
              "every fault hook has a name");

}  // namespace

extern "C" int HoOnnxTest_SetFault(const char* name, int64_t value) {
  if (name == nullptr) return ho::c_api_failed("HoOnnxTest_SetFault: name is NULL");
  ho::c_api_clear_error();
  for (const HookName& h : kHooks) {
    if (std::strcmp(name, h.name) == 0) {
      ho::faults::hook_table()[static_cast<int>(h.hook)].store(value);
      return 0;
    }
  }
  return ho::c_api_failed(std::string("HoOnnxTest_SetFault: unknown hook '") + name + "'");
}
