// The library's own C API (ho_onnx_c_api.h): counters, build facts, measurement switches and
// CUDA helpers for hosts, the Python module ho_onnx._ops among them. No exception crosses it.
#include "ho_onnx_c_api.h"

#include <cstdio>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "c_api_error.h"
#include "common.h"
#include "disk_io.h"
#include "fault_hooks.h"
#include "host_memory.h"
#include "ort_abi.h"
#include "registration.h"
#if HO_ONNX_WITH_CUDA
#include "cuda/cuda_api.h"
#include "cuda/probe.h"
#endif

#ifndef HO_ONNX_VERSION
#define HO_ONNX_VERSION "0.0.0"
#endif
#ifndef HO_ONNX_CXX_COMPILER
#define HO_ONNX_CXX_COMPILER "unknown"
#endif

namespace {

thread_local std::string g_last_error;

int failed(const std::string& msg) {
  g_last_error = msg;
  return -1;
}

// Runs f (returns void); a C++ exception becomes -1 with its text in g_last_error.
template <typename F>
int guarded(F&& f) {
  try {
    g_last_error.clear();
    f();
    return 0;
  } catch (const std::exception& e) {
    return failed(e.what());
  } catch (...) {
    return failed("unknown C++ exception");
  }
}

std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out;
}

std::string build_info_json() {
  std::string j = "{\"version\": \"" + json_escape(HO_ONNX_VERSION) + "\"";
  j += ", \"ort_api_version\": " + std::to_string(ORT_API_VERSION);
  j += ", \"ort_api_required\": " + std::to_string(HO_ONNX_ORT_API_REQUIRED);
  j += ", \"ort_min_version\": \"" + json_escape(HO_ONNX_ORT_MIN_VERSION) + "\"";
  j += ", \"c_api_version\": " + std::to_string(HO_ONNX_C_API_VERSION);
  j += std::string(", \"cuda_compiled\": ") + (HO_ONNX_WITH_CUDA ? "true" : "false");
  j += ", \"cxx_compiler\": \"" + json_escape(HO_ONNX_CXX_COMPILER) + "\"";
  j += std::string(", \"test_hooks\": ") + (HO_ONNX_TEST_HOOKS ? "true" : "false");
  j += ", \"element_types\": [";
  for (const ho::ElemType* t = ho::elem_types(); t->bits != 0; ++t) {
    if (t != ho::elem_types()) j += ", ";
    j += "\"" + json_escape(t->name) + "\"";
  }
  j += "]}";
  return j;
}

struct CounterDef {
  const char* name;
  int64_t (*get)();
};

#define HO_COUNTER(field) \
  {#field, [] { return static_cast<int64_t>(ho::counters().field.load()); }}
const CounterDef kCounters[] = {
    HO_COUNTER(bytes_loaded),
    HO_COUNTER(bytes_stored),
    HO_COUNTER(prefetches),
    HO_COUNTER(stores),
    HO_COUNTER(waits),
    HO_COUNTER(wait_ns),
    HO_COUNTER(alias_copies),
    HO_COUNTER(bytes_emitted),
    HO_COUNTER(gated_skips),
    HO_COUNTER(bytes_gated),
    HO_COUNTER(bytes_gathered),
    HO_COUNTER(host_matmuls),
    HO_COUNTER(host_matmul_rows),
    HO_COUNTER(bytes_read_disk),
    HO_COUNTER(disk_staging_bytes),
    HO_COUNTER(disk_staging_peak),
    HO_COUNTER(disk_read_ns),
    HO_COUNTER(disk_direct_reads),
    HO_COUNTER(disk_buffered_reads),
    HO_COUNTER(disk_reopens),
    HO_COUNTER(expert_cache_hits),
    HO_COUNTER(expert_cache_misses),
    HO_COUNTER(bytes_expert_cache_hit),
    HO_COUNTER(expert_cache_bytes),  // (a gauge: bytes the expert caches hold now)
    HO_COUNTER(warm_reads),
    HO_COUNTER(bytes_warm_read),
    HO_COUNTER(warm_present),
    HO_COUNTER(warm_hits),
    HO_COUNTER(read_aheads),
    HO_COUNTER(bytes_read_ahead),
    HO_COUNTER(read_ahead_used),
    HO_COUNTER(kernel_create_ns),  // (session creation: not reset)
    HO_COUNTER(weight_load_ns),
    // data files whose descriptors the disk tier holds now (a gauge, disk_io.h)
    {"disk_files_open", [] { return static_cast<int64_t>(ho::disk_open_files_now()); }},
    HO_COUNTER(host_store_bytes),
    HO_COUNTER(host_pool_bytes_in_use),
    HO_COUNTER(host_pool_bytes_reserved),
    HO_COUNTER(host_pool_allocs),
    HO_COUNTER(engines_alive),
    HO_COUNTER(pinned_bytes),
    HO_COUNTER(device_staging_bytes),
    HO_COUNTER(pinned_allocs),
    HO_COUNTER(cuda_events_created),
    HO_COUNTER(ring_segments),
    HO_COUNTER(ops_cpu),
    HO_COUNTER(ops_cuda),
    HO_COUNTER(cuda_bytes_h2d),
    HO_COUNTER(cuda_bytes_d2h),
    HO_COUNTER(cuda_bytes_d2d),
    HO_COUNTER(ort_arena_in_use),
    HO_COUNTER(ort_arena_max_in_use),
    HO_COUNTER(ort_arena_total_allocated),
    HO_COUNTER(registrations),
    HO_COUNTER(cuda_registrations),
    // registrations the process holds (never freed; bounded: registration.h)
    {"registrations_held", [] { return static_cast<int64_t>(ho::registrations_held()); }},
};
#undef HO_COUNTER
constexpr size_t kCounterCount = sizeof(kCounters) / sizeof(kCounters[0]);

#if !HO_ONNX_WITH_CUDA
int no_cuda(const char* what) {
  return failed(std::string(what) + ": ho_onnx was built without CUDA");
}
#endif

// The measurement switches by name (HoOnnx_SetTrace).
struct TraceSwitch {
  const char* name;
  std::atomic<bool> ho::Tracing::*flag;
};
const TraceSwitch kTraceSwitches[] = {
    {"cuda_timing", &ho::Tracing::cuda_timing},
    {"arena_trace", &ho::Tracing::arena_trace},
};

}  // namespace

namespace ho {
void c_api_clear_error() { g_last_error.clear(); }
int c_api_failed(const std::string& msg) { return failed(msg); }
}  // namespace ho

extern "C" {

int HoOnnx_ApiVersion(void) { return HO_ONNX_C_API_VERSION; }

const char* HoOnnx_LastError(void) { return g_last_error.c_str(); }

const char* HoOnnx_BuildInfoJson(void) {
  static const std::string info = build_info_json();
  return info.c_str();
}

size_t HoOnnx_GetCounters(const char** names, int64_t* values, size_t capacity) {
  for (size_t i = 0; i < kCounterCount && i < capacity; ++i) {
    if (names != nullptr) names[i] = kCounters[i].name;
    if (values != nullptr) values[i] = kCounters[i].get();
  }
  return kCounterCount;
}

size_t HoOnnx_ArenaTrace(HoOnnxArenaSample* out, size_t capacity, int reset) {
  // Only what is copied is forgotten: samples beyond `capacity` (or that arrive meanwhile)
  // stay for the next call. No exception crosses the C API: a copy that cannot be made
  // reports no samples and forgets none.
  try {
    size_t total = 0;
    const size_t take = out == nullptr ? 0 : capacity;
    const std::vector<ho::ArenaSample> t = ho::arena_trace(take, reset != 0, &total);
    for (size_t i = 0; i < t.size(); ++i) {
      std::snprintf(out[i].node, sizeof(out[i].node), "%s", t[i].where.c_str());
      out[i].in_use = t[i].in_use;
      out[i].max_in_use = t[i].max_in_use;
      out[i].total_allocated = t[i].total_allocated;
    }
    return total;
  } catch (...) {
    return 0;
  }
}

void HoOnnx_ResetCounters(void) {
  ho::Counters& c = ho::counters();
  c.bytes_loaded = 0;
  c.bytes_stored = 0;
  c.prefetches = 0;
  c.stores = 0;
  c.waits = 0;
  c.wait_ns = 0;
  c.alias_copies = 0;
  c.bytes_emitted = 0;
  c.gated_skips = 0;
  c.bytes_gated = 0;
  c.bytes_gathered = 0;
  c.host_matmuls = 0;
  c.host_matmul_rows = 0;
  c.bytes_read_disk = 0;
  c.disk_staging_peak = c.disk_staging_bytes.load();  // (a gauge and its peak from now)
  c.disk_read_ns = 0;
  c.disk_direct_reads = 0;
  c.disk_buffered_reads = 0;
  c.disk_reopens = 0;
  c.expert_cache_hits = 0;
  c.expert_cache_misses = 0;
  c.bytes_expert_cache_hit = 0;
  c.warm_reads = 0;
  c.bytes_warm_read = 0;
  c.warm_present = 0;
  c.warm_hits = 0;
  c.read_aheads = 0;
  c.bytes_read_ahead = 0;
  c.read_ahead_used = 0;
  c.ops_cpu = 0;
  c.ops_cuda = 0;
  c.cuda_bytes_h2d = 0;
  c.cuda_bytes_d2h = 0;
  c.cuda_bytes_d2d = 0;
}

int HoOnnx_SetTrace(const char* name, int on) {
  if (name == nullptr) return failed("HoOnnx_SetTrace: name is NULL");
  g_last_error.clear();
  for (const TraceSwitch& t : kTraceSwitches) {
    if (std::strcmp(name, t.name) == 0) {
      (ho::tracing().*t.flag) = on != 0;
      return 0;
    }
  }
  return failed(std::string("HoOnnx_SetTrace: unknown switch '") + name + "'");
}

int HoOnnx_CudaDeviceCount(void) {
#if HO_ONNX_WITH_CUDA
  std::string err;
  const int n = ho_cuda_device_count(&err);
  g_last_error = err;
  return n;
#else
  g_last_error = "ho_onnx was built without CUDA";
  return 0;
#endif
}

namespace {

// HoOnnx_HostAlloc's blocks by address (a PinnedBlock or a HostBytes behind the holder).
struct HostAllocs {
  std::mutex mu;
  std::map<void*, std::shared_ptr<void>> blocks;
};
HostAllocs& host_allocs() {
  static HostAllocs* h = new HostAllocs;  // never destroyed: frees may come at exit
  return *h;
}

// Pinned when CUDA can pin; otherwise (no CUDA build, no device, pinning refused) ordinary
// zero-filled pages.
std::shared_ptr<void> host_block(size_t size, void** data, int* pinned) {
#if HO_ONNX_WITH_CUDA
  std::string err;
  if (ho_cuda_device_count(&err) > 0) {
    try {
      std::shared_ptr<void> b = ho::cuda_pinned_host(size, data);
      *pinned = 1;
      return b;
    } catch (const std::exception&) {  // e.g. the pinned limit: pageable bytes still work
    }
  }
#endif
  std::shared_ptr<ho::HostBytes> b;
  try {
    b = std::make_shared<ho::HostBytes>(size, 4096);
  } catch (const std::bad_alloc&) {
    throw std::runtime_error("HoOnnx_HostAlloc: cannot map " + std::to_string(size) +
                             " bytes of host memory");
  }
  if (size < ho::HostBytes::kMappedBytes) std::memset(b->data(), 0, size);  // mapped: zero
  *data = b->data();
  *pinned = 0;
  return b;
}

}  // namespace

int HoOnnx_HostAlloc(uint64_t size, void** out, int* pinned) {
  if (out == nullptr) return failed("HoOnnx_HostAlloc: out is NULL");
  *out = nullptr;
  if (size == 0) return failed("HoOnnx_HostAlloc: size must be positive");
  return guarded([&] {
    void* data = nullptr;
    int was_pinned = 0;
    std::shared_ptr<void> b = host_block(static_cast<size_t>(size), &data, &was_pinned);
    HostAllocs& h = host_allocs();
    std::lock_guard<std::mutex> lock(h.mu);
    h.blocks.emplace(data, std::move(b));
    *out = data;
    if (pinned != nullptr) *pinned = was_pinned;
  });
}

int HoOnnx_HostFree(void* ptr) {
  std::shared_ptr<void> b;  // released outside the lock (unpinning takes time)
  {
    HostAllocs& h = host_allocs();
    std::lock_guard<std::mutex> lock(h.mu);
    auto it = h.blocks.find(ptr);
    if (it == h.blocks.end()) {
      return failed("HoOnnx_HostFree: not an address HoOnnx_HostAlloc returned (or freed twice)");
    }
    b = std::move(it->second);
    h.blocks.erase(it);
  }
  g_last_error.clear();
  return 0;
}

int HoOnnx_CudaMemInfo(int device, uint64_t* free_bytes, uint64_t* total_bytes) {
#if HO_ONNX_WITH_CUDA
  return guarded([&] {
    const ho::CudaMemInfo m = ho::cuda_mem_info(device);
    if (free_bytes != nullptr) *free_bytes = m.free_bytes;
    if (total_bytes != nullptr) *total_bytes = m.total_bytes;
  });
#else
  (void)device;
  (void)free_bytes;
  (void)total_bytes;
  return no_cuda("cuda_mem_info");
#endif
}

int HoOnnx_CudaCalibrate(uint64_t bytes, int device, int repeats, HoOnnxCudaCalibration* out) {
  if (out == nullptr) return failed("HoOnnx_CudaCalibrate: out is NULL");
#if HO_ONNX_WITH_CUDA
  return guarded([&] {
    const ho::CudaCalibration c = ho::cuda_calibrate(static_cast<size_t>(bytes), device, repeats);
    std::memset(out, 0, sizeof *out);
    out->h2d_bw = c.h2d_bw;
    out->d2h_bw = c.d2h_bw;
    out->bytes = c.bytes;
    out->device = c.device;
    std::snprintf(out->device_name, sizeof out->device_name, "%s", c.device_name.c_str());
  });
#else
  (void)bytes;
  (void)device;
  (void)repeats;
  return no_cuda("cuda_calibrate");
#endif
}

int HoOnnx_CudaTransferTimes(int reset, HoOnnxCudaTransferTimes* out) {
  if (out == nullptr) return failed("HoOnnx_CudaTransferTimes: out is NULL");
#if HO_ONNX_WITH_CUDA
  return guarded([&] {
    const ho::CudaTransferTimes t = ho::cuda_transfer_times(reset != 0);
    out->h2d_bytes = t.h2d_bytes;
    out->h2d_s = t.h2d_s;
    out->h2d_copies = t.h2d_copies;
    out->d2h_bytes = t.d2h_bytes;
    out->d2h_s = t.d2h_s;
    out->d2h_copies = t.d2h_copies;
  });
#else
  (void)reset;
  return no_cuda("cuda_transfer_times");
#endif
}

}  // extern "C"
