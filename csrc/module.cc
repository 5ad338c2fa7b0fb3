// The pybind11 module ho_onnx._ops: build facts, counters and test hooks. The same shared
// library is the ORT custom-op library (ops.cc: RegisterCustomOps).
#include <pybind11/pybind11.h>

#include <string>

#include "common.h"
#if HO_ONNX_WITH_CUDA
#include "cuda/probe.h"
#endif

namespace py = pybind11;

#ifndef HO_ONNX_VERSION
#define HO_ONNX_VERSION "0.0.0"
#endif
#ifndef HO_ONNX_CXX_COMPILER
#define HO_ONNX_CXX_COMPILER "unknown"
#endif

namespace {

py::dict build_info() {
  py::dict d;
  d["version"] = HO_ONNX_VERSION;
  d["ort_api_version"] = ORT_API_VERSION;
#if HO_ONNX_WITH_CUDA
  d["cuda_compiled"] = true;
#else
  d["cuda_compiled"] = false;
#endif
  d["cxx_compiler"] = HO_ONNX_CXX_COMPILER;
  py::list types;
  for (const ho::ElemType* t = ho::elem_types(); t->bits != 0; ++t) types.append(t->name);
  d["element_types"] = types;
  return d;
}

int cuda_device_count() {
#if HO_ONNX_WITH_CUDA
  std::string err;
  return ho_cuda_device_count(&err);
#else
  return 0;
#endif
}

py::dict counters() {
  const ho::Counters& c = ho::counters();
  py::dict d;
  d["bytes_loaded"] = c.bytes_loaded.load();
  d["bytes_stored"] = c.bytes_stored.load();
  d["prefetches"] = c.prefetches.load();
  d["stores"] = c.stores.load();
  d["waits"] = c.waits.load();
  d["wait_ns"] = c.wait_ns.load();
  d["alias_copies"] = c.alias_copies.load();
  d["bytes_read_disk"] = c.bytes_read_disk.load();
  d["disk_read_ns"] = c.disk_read_ns.load();
  d["disk_direct_reads"] = c.disk_direct_reads.load();
  d["disk_buffered_reads"] = c.disk_buffered_reads.load();
  d["host_store_bytes"] = c.host_store_bytes.load();
  d["host_pool_bytes_in_use"] = c.host_pool_bytes_in_use.load();
  d["host_pool_bytes_reserved"] = c.host_pool_bytes_reserved.load();
  d["engines_alive"] = c.engines_alive.load();
  return d;
}

void reset_counters() {
  ho::Counters& c = ho::counters();
  c.bytes_loaded = 0;
  c.bytes_stored = 0;
  c.prefetches = 0;
  c.stores = 0;
  c.waits = 0;
  c.wait_ns = 0;
  c.alias_copies = 0;
  c.bytes_read_disk = 0;
  c.disk_read_ns = 0;
  c.disk_direct_reads = 0;
  c.disk_buffered_reads = 0;
}

void set_debug(int64_t delay_us, bool poison, bool skip_wait) {
  ho::Debug& d = ho::debug();
  d.delay_us = delay_us < 0 ? 0 : delay_us;
  d.poison = poison;
  d.skip_wait = skip_wait;
}

}  // namespace

PYBIND11_MODULE(_ops, m) {
  m.doc() = "ho-onnx native library: ORT custom ops (ai.hyperoffload) and their counters";
  m.attr("__version__") = HO_ONNX_VERSION;
  m.def("build_info", &build_info,
        "Build facts: version, ort_api_version, cuda_compiled, cxx_compiler, element_types.");
  m.def("cuda_device_count", &cuda_device_count,
        "CUDA devices visible (0 without a CUDA build, a driver or a device).");
  m.def("counters", &counters, "Process-wide transfer and memory counters.");
  m.def("reset_counters", &reset_counters,
        "Reset the monotonic counters (bytes, counts, wait time); gauges are kept.");
  m.def("set_debug", &set_debug, py::arg("delay_us") = 0, py::arg("poison") = false,
        py::arg("skip_wait") = false,
        "Test hooks: delay every transfer, poison Prefetch outputs, make Wait/Detach not wait.");
}
