// The pybind11 module ho_onnx._ops: build facts, counters, measurement switches and CUDA
// helpers. Everything about the ORT custom ops comes from the custom-op library
// libho_onnx_ops.so through its C API (ho_onnx_c_api.h): the module links to it, and ORT
// later loads that same file, so both see one copy of its process-wide state. Nothing for
// tests is here: fault hooks and harnesses are the testing build's ho_onnx._ops_testing
// (csrc/testing/module.cc).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "fnv1a.h"
#include "ho_onnx_c_api.h"
#include "py_switches.h"

namespace py = pybind11;

namespace {

// A failed C API call raises RuntimeError with the library's message.
void check(int rc) {
  if (rc != 0) throw std::runtime_error(HoOnnx_LastError());
}

py::dict build_info() {
  py::dict d = py::module_::import("json").attr("loads")(HoOnnx_BuildInfoJson());
  return d;
}

int cuda_device_count() { return HoOnnx_CudaDeviceCount(); }

py::dict counters() {
  const size_t n = HoOnnx_GetCounters(nullptr, nullptr, 0);
  std::vector<const char*> names(n);
  std::vector<int64_t> values(n);
  HoOnnx_GetCounters(names.data(), values.data(), n);
  py::dict d;
  for (size_t i = 0; i < n; ++i) d[names[i]] = values[i];
  return d;
}

void reset_counters() { HoOnnx_ResetCounters(); }

// FNV-1a 64 of data from state h (the fingerprint's hash, the library's own code).
uint64_t fnv1a64(uint64_t h, const py::buffer& data) {
  const py::buffer_info info = data.request();
  if (info.ndim != 1 || info.itemsize != 1) {
    throw py::type_error("fnv1a64: data must be a 1-D buffer of bytes");
  }
  if (info.strides[0] != 1 && info.shape[0] > 1) {
    throw py::type_error("fnv1a64: data must be contiguous");
  }
  const auto* p = static_cast<const unsigned char*>(info.ptr);
  const auto n = static_cast<size_t>(info.shape[0]);
  py::gil_scoped_release release;
  return ho::fnv1a64(h, p, n);
}

// The measurement switches of HoOnnx_SetTrace: set_trace(**kw) sets those named and resets
// the rest.
const char* const kTraceSwitches[] = {"cuda_timing", "arena_trace"};

void set_trace(const py::kwargs& kw) {
  ho_py::set_switches<bool>(kw, kTraceSwitches, HoOnnx_SetTrace, "set_trace", "switch");
}

py::tuple cuda_mem_info(int device) {
  uint64_t free_bytes = 0, total_bytes = 0;
  check(HoOnnx_CudaMemInfo(device, &free_bytes, &total_bytes));
  return py::make_tuple(free_bytes, total_bytes);
}

py::dict cuda_calibrate(size_t bytes, int device, int repeats) {
  HoOnnxCudaCalibration c{};
  int rc = 0;
  {
    py::gil_scoped_release nogil;
    rc = HoOnnx_CudaCalibrate(bytes, device, repeats, &c);
  }
  check(rc);
  py::dict d;
  d["h2d_bw"] = c.h2d_bw;
  d["d2h_bw"] = c.d2h_bw;
  d["bytes"] = c.bytes;
  d["device"] = c.device;
  d["device_name"] = std::string(c.device_name);
  return d;
}

py::list arena_trace(bool reset) {
  std::vector<HoOnnxArenaSample> buf;
  {
    py::gil_scoped_release nogil;
    // Samples may arrive between sizing and copying: with reset, what did not fit stays in
    // the trace and the next round takes it; without, one copy of what fits.
    for (size_t room = HoOnnx_ArenaTrace(nullptr, 0, 0) + 64;; room = 64) {
      const size_t at = buf.size();
      buf.resize(at + room);
      const size_t there = HoOnnx_ArenaTrace(buf.data() + at, room, reset ? 1 : 0);
      buf.resize(at + std::min(room, there));
      if (!reset || there <= room) break;
    }
  }
  py::list out;
  for (const HoOnnxArenaSample& s : buf) {
    py::dict d;
    d["node"] = std::string(s.node);
    d["in_use"] = s.in_use;
    d["max_in_use"] = s.max_in_use;
    d["total_allocated"] = s.total_allocated;
    out.append(d);
  }
  return out;
}

py::dict cuda_transfer_times(bool reset) {
  HoOnnxCudaTransferTimes t{};
  int rc = 0;
  {
    py::gil_scoped_release nogil;
    rc = HoOnnx_CudaTransferTimes(reset ? 1 : 0, &t);
  }
  check(rc);
  py::dict d;
  d["h2d_bytes"] = t.h2d_bytes;
  d["h2d_s"] = t.h2d_s;
  d["h2d_copies"] = t.h2d_copies;
  d["d2h_bytes"] = t.d2h_bytes;
  d["d2h_s"] = t.d2h_s;
  d["d2h_copies"] = t.d2h_copies;
  return d;
}

// HoOnnx_HostAlloc's bytes as a Python buffer (numpy.frombuffer views keep it alive).
class HostBuffer {
 public:
  explicit HostBuffer(uint64_t size) : size_(size) {
    int pinned = 0;
    check(HoOnnx_HostAlloc(size, &data_, &pinned));
    pinned_ = pinned != 0;
  }
  ~HostBuffer() {
    if (data_ != nullptr) (void)HoOnnx_HostFree(data_);
  }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  void* data() const { return data_; }
  uint64_t size() const { return size_; }
  bool pinned() const { return pinned_; }

 private:
  void* data_ = nullptr;
  uint64_t size_ = 0;
  bool pinned_ = false;
};

}  // namespace

// Over 60 lines: the module's table of bindings, one m.def per Python name with its
// docstring (no logic to split out).
PYBIND11_MODULE(_ops, m) {
  m.doc() = "ho-onnx native module: counters and build facts of the custom-op library";
  if (HoOnnx_ApiVersion() != HO_ONNX_C_API_VERSION) {
    throw std::runtime_error("ho_onnx._ops: libho_onnx_ops C API version " +
                             std::to_string(HoOnnx_ApiVersion()) + ", expected " +
                             std::to_string(HO_ONNX_C_API_VERSION));
  }
  m.attr("__version__") = build_info()["version"];
  m.def("build_info", &build_info,
        "Build facts: version, ort_api_version, c_api_version, cuda_compiled, cxx_compiler, "
        "test_hooks, element_types.");
  m.def("cuda_device_count", &cuda_device_count,
        "CUDA devices visible (0 without a CUDA build, a driver or a device).");
  m.def("counters", &counters, "Process-wide transfer and memory counters.");
  m.def("fnv1a64", &fnv1a64, py::arg("h"), py::arg("data"),
        "FNV-1a 64 of the bytes of data (a bytes-like object) from state h: the hash of the "
        "data-file fingerprint, as the library computes it.");
  m.def("reset_counters", &reset_counters,
        "Reset the monotonic counters (bytes, counts, wait time); gauges are kept.");
  m.def("set_trace", &set_trace,
        "Measurement switches, each off unless named (set_trace() turns all off): "
        "cuda_timing (time every copy of the CUDA engine: cuda_transfer_times), arena_trace "
        "(keep every arena sample: arena_trace).");
  m.def("arena_trace", &arena_trace, py::arg("reset") = true,
        "ORT arena samples (node, in_use, max_in_use, total_allocated; bytes) taken at each "
        "Wait and Fence, oldest first, while set_trace(arena_trace=True) and the session has "
        "ho_onnx.sample_arena=1.");
  m.def("cuda_mem_info", &cuda_mem_info, py::arg("device") = 0,
        "(free, total) bytes of a CUDA device (cudaMemGetInfo: every allocation on the "
        "device, ONNX Runtime's included). RuntimeError without CUDA.");
  m.def("cuda_calibrate", &cuda_calibrate, py::arg("bytes") = size_t{256} << 20,
        py::arg("device") = 0, py::arg("repeats") = 16,
        "Pinned host <-> device copy rates (bytes/s, best of `repeats` single "
        "cudaMemcpyAsync of `bytes`, in four groups 50 ms apart after a warm-up): "
        "dict(h2d_bw, d2h_bw, bytes, device, device_name).");
  py::class_<HostBuffer>(m, "HostBuffer", py::buffer_protocol(),
                         "`nbytes` of zero-filled, page-aligned host memory, pinned where the "
                         "library has CUDA and a device (HoOnnx_HostAlloc); a writable buffer.")
      .def(py::init<uint64_t>(), py::arg("nbytes"))
      .def_property_readonly("pinned", &HostBuffer::pinned,
                             "Page-locked and registered with CUDA.")
      .def_property_readonly("address", [](const HostBuffer& b) {
        return reinterpret_cast<uintptr_t>(b.data());
      })
      .def("__len__", [](const HostBuffer& b) { return static_cast<size_t>(b.size()); })
      .def_buffer([](HostBuffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.size())}, {py::ssize_t{1}});
      });
  m.def("cuda_transfer_times", &cuda_transfer_times, py::arg("reset") = true,
        "Bytes and GPU seconds of the engine's copies timed while set_trace(cuda_timing=True).");
}
