// The C API's per-thread error (HoOnnx_LastError), for the C API functions defined outside
// c_api.cc (csrc/testing/fault_hooks.cc).
#pragma once

#include <string>

namespace ho {

// Forget this thread's last error (a C API call starts with it).
void c_api_clear_error();
// Record `msg` as this thread's last error and return -1 (the C API's failure value).
int c_api_failed(const std::string& msg);

}  // namespace ho
