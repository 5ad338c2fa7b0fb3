// The keyword form of the library's named switches for the pybind11 modules: f(**kw) sets
// the switches named and resets the others (f() resets all). ho_onnx._ops: set_trace
// (HoOnnx_SetTrace); ho_onnx._ops_testing: set_debug (HoOnnxTest_SetFault).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "ho_onnx_c_api.h"

namespace ho_py {

// `set(name, value)` is the C API's setter (0 or -1 with HoOnnx_LastError); `names` every
// switch it knows; `what` (the Python name) and `noun` go into the error for an unknown name.
template <typename Value, size_t N, typename Set>
void set_switches(const pybind11::kwargs& kw, const char* const (&names)[N], Set set,
                  const char* what, const char* noun) {
  for (auto item : kw) {
    const std::string name = pybind11::str(item.first);
    bool known = false;
    for (const char* n : names) known = known || name == n;
    if (!known) {
      throw pybind11::type_error(std::string(what) + ": unknown " + noun + " '" + name + "'");
    }
  }
  for (const char* n : names) {
    Value v = 0;
    if (kw.contains(n)) v = pybind11::cast<Value>(kw[n]);
    if (set(n, v) != 0) throw std::runtime_error(HoOnnx_LastError());
  }
}

}  // namespace ho_py
