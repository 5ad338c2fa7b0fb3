// What the library needs of the ONNX Runtime ABI beyond the API version it requires: the
// version it asks for, facts about the runtime (its release, the element types it knows),
// and the optional entries of a newer OrtApi table (the allocator statistics of API 23)
// resolved by position.
#pragma once

#include <onnxruntime_c_api.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

// Declared by onnxruntime_c_api.h from API 22 on; the library may be built with older headers.
struct OrtKeyValuePairs;

namespace ho {

// The ORT C API version the library asks the runtime for and declares in its OrtCustomOps:
// the newest it uses (KernelInfoGetAllocator and OrtCustomOp::GetAliasMap/ReleaseAliasMap
// came with API 18, onnxruntime 1.18; CMakeLists.txt sets HO_ONNX_ORT_API_REQUIRED). A
// runtime serves every API version up to its own from one append-only function table, so
// 1.18 and every later release load the library; the headers it is compiled with may be
// newer (ORT_API_VERSION).
constexpr uint32_t kOrtApiVersion = HO_ONNX_ORT_API_REQUIRED;
static_assert(ORT_API_VERSION >= kOrtApiVersion, "ONNX Runtime headers older than the API used");

// (major, minor) of a runtime version string such as "1.21.1"; (0, 0) when unparsable.
std::pair<int, int> runtime_version(const char* v);

// Whether the runtime of release `rt` knows element type `t` (types newer than the runtime
// are not registered: ORT would refuse every session).
bool runtime_has_type(ONNXTensorElementDataType t, std::pair<int, int> rt);

// ORT's allocator statistics (AllocatorGetStats and the OrtKeyValuePairs accessors), taken
// from the API 23 table; every member null when the runtime or the headers do not allow it.
struct StatsApi {
  using GetStats = OrtStatus*(ORT_API_CALL*)(const OrtAllocator*, OrtKeyValuePairs**);
  using GetPairs = void(ORT_API_CALL*)(const OrtKeyValuePairs*, const char* const**,
                                       const char* const**, size_t*);
  using ReleasePairs = void(ORT_API_CALL*)(OrtKeyValuePairs*);
  GetStats get_stats = nullptr;
  GetPairs get_pairs = nullptr;
  ReleasePairs release_pairs = nullptr;
  bool ok() const { return get_stats && get_pairs && release_pairs; }
};

// Empty (ok() false) when the runtime is older than 1.23 or the headers' layout is unknown.
StatsApi resolve_stats_api(const OrtApiBase* base, std::pair<int, int> runtime);

// A kernel's session config entries (OrtApi::KernelInfo_GetConfigEntries, API 24,
// onnxruntime 1.24) and the OrtKeyValuePairs accessors of API 22: a kernel then reads
// `ho_onnx.model_dir` of its own session, so one registration serves every model folder.
struct KernelConfigApi {
  using GetEntries = OrtStatus*(ORT_API_CALL*)(const OrtKernelInfo*, OrtKeyValuePairs**);
  using GetValue = const char*(ORT_API_CALL*)(const OrtKeyValuePairs*, const char*);
  using ReleasePairs = void(ORT_API_CALL*)(OrtKeyValuePairs*);
  GetEntries get_entries = nullptr;
  GetValue get_value = nullptr;
  ReleasePairs release_pairs = nullptr;
  bool ok() const { return get_entries && get_value && release_pairs; }
};

// Empty (ok() false) when the runtime is older than 1.24 or the headers' layout is unknown;
// HO_ONNX_KERNEL_CONFIG=0 leaves it empty (tests: the path of older runtimes).
KernelConfigApi resolve_kernel_config_api(const OrtApiBase* base, std::pair<int, int> runtime);

// The value of session config entry `key` of the kernel's session: false when it is not
// set. Throws ho::Error when ORT returns an error.
bool kernel_config_entry(const KernelConfigApi& k, const OrtApi* api, const OrtKernelInfo* info,
                         const char* key, std::string* value);

// Records InUse / MaxInUse / TotalAllocated of `alloc` into the ort_arena_* counters, and
// with tracing().arena_trace also into the trace under `where` (the sampling node's name).
// Never fails (a measurement, not a transfer).
void sample_arena(const StatsApi& s, const OrtApi* api, const OrtAllocator* alloc,
                  const std::string& where);

// One arena sample of the trace.
struct ArenaSample {
  std::string where;
  int64_t in_use = -1;
  int64_t max_in_use = -1;
  int64_t total_allocated = -1;
};
constexpr size_t kArenaTraceCap = size_t{1} << 16;
// The oldest `take` samples kept (all: SIZE_MAX), erased from the trace with `erase`;
// `total` is how many there were.
std::vector<ArenaSample> arena_trace(size_t take, bool erase, size_t* total);

}  // namespace ho
