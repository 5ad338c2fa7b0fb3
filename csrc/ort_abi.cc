// The ORT ABI facts of ort_abi.h: runtime release and element types, and the allocator
// statistics of API 23 found by their position in the OrtApi table.
#include "ort_abi.h"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>

#include "common.h"
#include "ort_tensor.h"

namespace ho {
namespace {

// ORT's allocator statistics (issue 11 item 5): OrtApi::AllocatorGetStats came with API 23
// (onnxruntime 1.23), the OrtKeyValuePairs accessors with API 22: above the API 18 the
// library requires. They are called only when the runtime serves API 23
// (OrtApiBase::GetApi(23), asked only of runtimes >= 1.23), through that table. With headers
// older than 23 the table positions are those of onnxruntime_c_api.h 1.23 (the table is
// append-only: a position never changes once released): API 21 ends with
// SetEpDynamicOptions at index 284; API 22 appends ReleaseValueInfo, ReleaseNode,
// ReleaseGraph, ReleaseModel, GetValueInfoName, GetValueInfoTypeInfo, GetModelEditorApi,
// CreateTensorWithDataAndDeleterAsOrtValue, SessionOptionsSetLoadCancellationFlag,
// GetCompileApi, CreateKeyValuePairs, AddKeyValuePair, GetKeyValue, GetKeyValuePairs (298),
// RemoveKeyValuePair, ReleaseKeyValuePairs (300), ... and API 23 GetTensorSizeInBytes (318),
// AllocatorGetStats (319). test_engine_cpu.py checks the result against the CPU arena.
constexpr uint32_t kStatsApiVersion = 23;
#if ORT_API_VERSION >= 23
constexpr bool kStatsKnown = true;
constexpr size_t kIdxGetKeyValuePairs = offsetof(OrtApi, GetKeyValuePairs) / sizeof(void*);
constexpr size_t kIdxReleaseKeyValuePairs = offsetof(OrtApi, ReleaseKeyValuePairs) / sizeof(void*);
constexpr size_t kIdxAllocatorGetStats = offsetof(OrtApi, AllocatorGetStats) / sizeof(void*);
#elif ORT_API_VERSION == 21
static_assert(offsetof(OrtApi, SetEpDynamicOptions) / sizeof(void*) == 284 &&
                  sizeof(OrtApi) == 285 * sizeof(void*),
              "OrtApi of API 21 does not have the layout the stats positions assume");
constexpr bool kStatsKnown = true;
constexpr size_t kIdxGetKeyValuePairs = 298;
constexpr size_t kIdxReleaseKeyValuePairs = 300;
constexpr size_t kIdxAllocatorGetStats = 319;
#else
constexpr bool kStatsKnown = false;  // headers of API 18-20 or 22: positions not checked here
constexpr size_t kIdxGetKeyValuePairs = 0;
constexpr size_t kIdxReleaseKeyValuePairs = 0;
constexpr size_t kIdxAllocatorGetStats = 0;
#endif

// KernelInfo_GetConfigEntries came with API 24 (onnxruntime 1.24). With headers older than
// 24 its position is that of onnxruntime_c_api.h 1.24: after AllocatorGetStats (319), API 23
// appends CreateMemoryInfo_V2 ... GetModelCompatibilityForEpDevices (388), and API 24
// CreateExternalInitializerInfo (389), TensorTypeAndShape_HasShape (390),
// KernelInfo_GetConfigEntries (391). test_registrations.py runs it on the installed runtime.
constexpr uint32_t kKernelConfigApiVersion = 24;
#if ORT_API_VERSION >= 24
constexpr bool kKernelConfigKnown = true;
constexpr size_t kIdxKernelInfoGetConfigEntries =
    offsetof(OrtApi, KernelInfo_GetConfigEntries) / sizeof(void*);
constexpr size_t kIdxGetKeyValue = offsetof(OrtApi, GetKeyValue) / sizeof(void*);
#elif ORT_API_VERSION == 21
constexpr bool kKernelConfigKnown = true;  // (layout asserted above)
constexpr size_t kIdxKernelInfoGetConfigEntries = 391;
constexpr size_t kIdxGetKeyValue = 297;
#else
constexpr bool kKernelConfigKnown = false;
constexpr size_t kIdxKernelInfoGetConfigEntries = 0;
constexpr size_t kIdxGetKeyValue = 0;
#endif

}  // namespace

std::pair<int, int> runtime_version(const char* v) {
  int major = 0, minor = 0;
  if (v == nullptr || std::sscanf(v, "%d.%d", &major, &minor) != 2) return {0, 0};
  return {major, minor};
}

// ORT refuses every session when an op of the library declares a type the runtime lacks
// ("tensor type N is not supported"), so types newer than the runtime are not registered (a
// model using them would not load without ho-onnx either). Measured with the onnxruntime
// wheels: INT4/UINT4 from 1.19, FLOAT4E2M1 (type 23) from 1.24; every other type of
// elem_types() is in 1.18.
bool runtime_has_type(ONNXTensorElementDataType t, std::pair<int, int> rt) {
  int since_minor = 0;
  switch (static_cast<int>(t)) {
    case 23:  // FLOAT4E2M1
      since_minor = 24;
      break;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT4:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT4:
      since_minor = 19;
      break;
    default:
      return true;
  }
  return rt.first > 1 || (rt.first == 1 && rt.second >= since_minor);
}

StatsApi resolve_stats_api(const OrtApiBase* base, std::pair<int, int> runtime) {
  StatsApi s;
  if (!kStatsKnown || runtime < std::make_pair(1, 23)) return s;
  const OrtApi* api = base->GetApi(kStatsApiVersion);
  if (api == nullptr) return s;
  void* const* table = reinterpret_cast<void* const*>(api);
  s.get_stats = reinterpret_cast<StatsApi::GetStats>(table[kIdxAllocatorGetStats]);
  s.get_pairs = reinterpret_cast<StatsApi::GetPairs>(table[kIdxGetKeyValuePairs]);
  s.release_pairs = reinterpret_cast<StatsApi::ReleasePairs>(table[kIdxReleaseKeyValuePairs]);
  return s;
}

KernelConfigApi resolve_kernel_config_api(const OrtApiBase* base, std::pair<int, int> runtime) {
  KernelConfigApi k;
  const char* env = std::getenv("HO_ONNX_KERNEL_CONFIG");
  if (env != nullptr && std::strcmp(env, "0") == 0) return k;
  if (!kKernelConfigKnown || runtime < std::make_pair(1, 24)) return k;
  const OrtApi* api = base->GetApi(kKernelConfigApiVersion);
  if (api == nullptr) return k;
  void* const* table = reinterpret_cast<void* const*>(api);
  k.get_entries = reinterpret_cast<KernelConfigApi::GetEntries>(table[kIdxKernelInfoGetConfigEntries]);
  k.get_value = reinterpret_cast<KernelConfigApi::GetValue>(table[kIdxGetKeyValue]);
  k.release_pairs = reinterpret_cast<KernelConfigApi::ReleasePairs>(table[kIdxReleaseKeyValuePairs]);
  return k;
}

bool kernel_config_entry(const KernelConfigApi& k, const OrtApi* api, const OrtKernelInfo* info,
                         const char* key, std::string* value) {
  OrtKeyValuePairs* kv = nullptr;
  check(api, k.get_entries(info, &kv));
  if (kv == nullptr) return false;
  std::unique_ptr<OrtKeyValuePairs, KernelConfigApi::ReleasePairs> owned(kv, k.release_pairs);
  const char* v = k.get_value(kv, key);
  if (v == nullptr) return false;
  *value = v;
  return true;
}

namespace {
std::mutex g_trace_mu;
std::vector<ArenaSample>& trace() {
  static auto* t = new std::vector<ArenaSample>();  // never destroyed: kernels may sample late
  return *t;
}
}  // namespace

std::vector<ArenaSample> arena_trace(size_t take, bool erase, size_t* total) {
  std::lock_guard<std::mutex> lock(g_trace_mu);
  std::vector<ArenaSample>& t = trace();
  *total = t.size();
  const auto end = t.begin() + static_cast<std::ptrdiff_t>(std::min(take, t.size()));
  std::vector<ArenaSample> out(t.begin(), end);
  if (erase) t.erase(t.begin(), end);
  return out;
}

// Names as ORT reports them. An allocator without statistics (not an arena) leaves the
// counters as they are. The trace keeps this sample's own values, not the counters read
// back: another session's Wait may store into them at the same time.
void sample_arena(const StatsApi& s, const OrtApi* api, const OrtAllocator* alloc,
                  const std::string& where) {
  if (!s.ok() || alloc == nullptr) return;
  OrtKeyValuePairs* kv = nullptr;
  OrtStatus* st = s.get_stats(alloc, &kv);
  if (st != nullptr) {
    api->ReleaseStatus(st);
    return;
  }
  if (kv == nullptr) return;
  std::unique_ptr<OrtKeyValuePairs, StatsApi::ReleasePairs> owned(kv, s.release_pairs);
  const char* const* keys = nullptr;
  const char* const* values = nullptr;
  size_t n = 0;
  s.get_pairs(kv, &keys, &values, &n);
  ArenaSample one;
  const struct {
    const char* key;
    std::atomic<int64_t>& counter;
    int64_t& value;
  } reported[] = {{"InUse", counters().ort_arena_in_use, one.in_use},
                  {"MaxInUse", counters().ort_arena_max_in_use, one.max_in_use},
                  {"TotalAllocated", counters().ort_arena_total_allocated, one.total_allocated}};
  for (size_t i = 0; i < n; ++i) {
    if (keys[i] == nullptr || values[i] == nullptr) continue;
    for (const auto& r : reported) {
      if (std::strcmp(keys[i], r.key) != 0) continue;
      r.value = std::strtoll(values[i], nullptr, 10);
      r.counter.store(r.value);
      break;
    }
  }
  if (!tracing().arena_trace.load()) return;
  try {  // (a test hook: a sample that cannot be kept is dropped, the run goes on)
    one.where = where;
    std::lock_guard<std::mutex> lock(g_trace_mu);
    if (trace().size() < kArenaTraceCap) trace().push_back(std::move(one));
  } catch (...) {
  }
}

}  // namespace ho
