// The ORT custom ops of domain "ai.hyperoffload" (Prefetch, Wait, Store, Detach) on the
// CPU execution provider and, in a CUDA build, on the CUDA execution provider; and the
// library entry point RegisterCustomOps.
//
// Each op is registered once per fixed-size element type T (ORT picks the overload by the
// type of input 0); the trailing `deps` input is a heterogeneous any-type variadic of
// arity >= 0 that is never read. A CUDA build registers a second OrtCustomOp per op and type
// whose GetExecutionProviderType is "CUDAExecutionProvider" when the runtime has that
// provider (OrtApi::GetAvailableProviders; HO_ONNX_CUDA_OPS=0/1 forces it off/on). Kernels
// call into the registration's Engine (engine.h): one CPU engine and one CUDA engine per
// registration, each created by the first kernel that needs it.
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "engine.h"
#include "weight_file.h"
#if HO_ONNX_WITH_CUDA
#include "cuda/cuda_api.h"
#endif

// Declared by onnxruntime_c_api.h from API 22 on; the library may be built with older headers.
struct OrtKeyValuePairs;

namespace ho {
#if !HO_ONNX_WITH_CUDA
// No CUDA-EP kernel exists in such a build.
inline void cuda_set_device(int) {}
#endif

namespace {

constexpr const char* kDomain = "ai.hyperoffload";
constexpr const char* kModelDirKey = "ho_onnx.model_dir";
// Bytes of activations the plan stores per run (sizes the CUDA engine's pinned ring at
// session creation). Also a Store attribute of the same meaning: `host_bytes`.
constexpr const char* kHostBytesKey = "ho_onnx.host_bytes";
constexpr const char* kHostBytesAttr = "host_bytes";
// Bound of the host pool of stored activations (bytes; default: half the physical memory).
constexpr const char* kPoolLimitKey = "ho_onnx.host_pool_limit_bytes";
constexpr const char* kCudaEp = "CUDAExecutionProvider";
constexpr const char* kCpuEp = "CPUExecutionProvider";

// The ORT C API version the library asks the runtime for and declares in its OrtCustomOps:
// the newest it uses (KernelInfoGetAllocator and OrtCustomOp::GetAliasMap/ReleaseAliasMap
// came with API 18, onnxruntime 1.18; CMakeLists.txt sets HO_ONNX_ORT_API_REQUIRED). A
// runtime serves every API version up to its own from one append-only function table, so
// 1.18 and every later release load the library; the headers it is compiled with may be
// newer (ORT_API_VERSION).
constexpr uint32_t kOrtApiVersion = HO_ONNX_ORT_API_REQUIRED;
static_assert(ORT_API_VERSION >= kOrtApiVersion, "ONNX Runtime headers older than the API used");

// ---------------------------------------------------------------------------------------
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

// Records InUse / MaxInUse / TotalAllocated of `alloc` (names as ORT reports them) into the
// ort_arena_* counters. An allocator without statistics (not an arena) leaves them as they
// are; nothing here fails the op (a measurement, not a transfer).
void sample_arena(const StatsApi& s, const OrtApi* api, const OrtAllocator* alloc) {
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
  for (size_t i = 0; i < n; ++i) {
    if (keys[i] == nullptr || values[i] == nullptr) continue;
    std::atomic<int64_t>* dst = nullptr;
    if (std::strcmp(keys[i], "InUse") == 0) dst = &counters().ort_arena_in_use;
    if (std::strcmp(keys[i], "MaxInUse") == 0) dst = &counters().ort_arena_max_in_use;
    if (std::strcmp(keys[i], "TotalAllocated") == 0) dst = &counters().ort_arena_total_allocated;
    if (dst != nullptr) dst->store(std::strtoll(values[i], nullptr, 10));
  }
}

enum class OpKind { kPrefetch, kWait, kStore, kDetach };

const char* op_name(OpKind k) {
  switch (k) {
    case OpKind::kPrefetch:
      return "Prefetch";
    case OpKind::kWait:
      return "Wait";
    case OpKind::kStore:
      return "Store";
    case OpKind::kDetach:
      return "Detach";
  }
  return "?";
}

// Number of T-typed inputs before the variadic `deps`.
size_t fixed_inputs(OpKind k) { return k == OpKind::kDetach ? 2 : 1; }

// ---------------------------------------------------------------------------------------
// Registration: the op domain for one library configuration (model directory, host bytes,
// pool limit, CUDA variants). The OrtCustomOpDomain and the op structs must outlive every
// session that uses them, and ORT gives no callback when that is over, so registrations are
// never released; RegisterCustomOps calls with the same configuration share one (and so
// one engine), so a server that creates and destroys sessions retains nothing per session.
// The engine, the only large thing, lives and dies with the registration's kernels.

struct OpDef;

struct Registration {
  const OrtApi* api = nullptr;
  std::string model_dir;   // from the session config entry, "" when not set
  int64_t host_bytes = -1;  // from the session config entry, -1 when not set
  EngineLimits limits;
  std::mutex mu;
  std::map<std::string, std::string> fingerprints;  // file identity + version -> fingerprint
  OrtCustomOpDomain* domain = nullptr;
  bool cuda = false;
  std::weak_ptr<Engine> engine;       // CPU EP kernels
  std::weak_ptr<Engine> cuda_engine;  // CUDA EP kernels
  StatsApi stats;                     // ORT allocator statistics (runtime >= 1.23)
  std::vector<std::unique_ptr<OpDef>> ops;

  // The data_fingerprint of an open data file, computed once per file and registration.
  // Keyed by the file's identity and version (size, mtime, ctime: any write changes ctime).
  std::string fingerprint(const WeightFile& f) {
    struct stat st {};
    if (::fstat(f.fd(), &st) != 0) fail(ORT_FAIL, "cannot stat '" + f.path() + "'");
    const std::string key = f.key() + ":" + std::to_string(st.st_size) + ":" +
                            std::to_string(st.st_mtim.tv_sec) + "." +
                            std::to_string(st.st_mtim.tv_nsec) + ":" +
                            std::to_string(st.st_ctim.tv_sec) + "." +
                            std::to_string(st.st_ctim.tv_nsec);
    {
      std::lock_guard<std::mutex> lock(mu);
      auto it = fingerprints.find(key);
      if (it != fingerprints.end()) return it->second;
    }
    std::string fp = data_fingerprint(f.fd(), static_cast<uint64_t>(st.st_size));
    std::lock_guard<std::mutex> lock(mu);
    if (fingerprints.size() >= 256) fingerprints.clear();  // bounded
    fingerprints.emplace(key, fp);
    return fp;
  }

  std::shared_ptr<Engine> acquire_engine(bool cuda) {
    std::lock_guard<std::mutex> lock(mu);
    std::weak_ptr<Engine>& slot = cuda ? cuda_engine : engine;
    std::shared_ptr<Engine> e = slot.lock();
    if (!e) {
#if HO_ONNX_WITH_CUDA
      e = cuda ? make_cuda_engine() : make_cpu_engine(limits);
#else
      if (cuda) fail(ORT_FAIL, "built without CUDA");
      e = make_cpu_engine(limits);
#endif
      slot = e;
    }
    return e;
  }
};

std::mutex g_regs_mu;
// configuration key -> registration; never freed (one entry per distinct configuration)
std::map<std::string, Registration*>* g_regs = new std::map<std::string, Registration*>();

struct OpDef : OrtCustomOp {
  OpKind kind;
  ONNXTensorElementDataType type;
  int bits;
  bool cuda;  // registered for the CUDA execution provider
  Registration* reg;
};

const OpDef* def(const OrtCustomOp* op) { return static_cast<const OpDef*>(op); }

// ---------------------------------------------------------------------------------------
// Small RAII helpers over the C API (every failing call becomes an ho::Error).

void check(const OrtApi* api, OrtStatus* st) {
  if (st == nullptr) return;
  const OrtErrorCode code = api->GetErrorCode(st);
  std::string msg = api->GetErrorMessage(st);
  api->ReleaseStatus(st);
  throw Error(code, msg);
}

struct TensorInfo {
  std::vector<int64_t> dims;
  size_t numel = 0;
};

TensorInfo tensor_info(const OrtApi* api, const OrtValue* v) {
  OrtTensorTypeAndShapeInfo* raw = nullptr;
  check(api, api->GetTensorTypeAndShape(v, &raw));
  std::unique_ptr<OrtTensorTypeAndShapeInfo, void (*)(OrtTensorTypeAndShapeInfo*)> info(
      raw, api->ReleaseTensorTypeAndShapeInfo);
  TensorInfo out;
  size_t n = 0;
  check(api, api->GetDimensionsCount(info.get(), &n));
  out.dims.resize(n);
  if (n != 0) check(api, api->GetDimensions(info.get(), out.dims.data(), n));
  check(api, api->GetTensorShapeElementCount(info.get(), &out.numel));
  return out;
}

void* tensor_data(const OrtApi* api, const OrtValue* v) {
  void* p = nullptr;
  check(api, api->GetTensorMutableData(const_cast<OrtValue*>(v), &p));
  return p;
}

const OrtValue* input(const OrtApi* api, OrtKernelContext* ctx, size_t i) {
  const OrtValue* v = nullptr;
  check(api, api->KernelContext_GetInput(ctx, i, &v));
  if (v == nullptr) fail(ORT_INVALID_ARGUMENT, "missing input " + std::to_string(i));
  return v;
}

OrtValue* output(const OrtApi* api, OrtKernelContext* ctx, const std::vector<int64_t>& dims) {
  OrtValue* v = nullptr;
  check(api, api->KernelContext_GetOutput(ctx, 0, dims.data(), dims.size(), &v));
  return v;
}

// Prefetch's optional second output `issued` (docs/design.md, op contract): an empty [0]
// tensor of T, produced once the transfer was issued and only when the node declares it. A
// later Prefetch of the same channel takes it as an ordering input (FIFO issue order)
// without keeping `y`, a full-size buffer, alive. On the CUDA EP it is a device tensor
// (nothing is written: zero bytes), so its consumers stay on the CUDA EP.
void produce_issued(const OrtApi* api, OrtKernelContext* ctx) {
  size_t n = 0;
  check(api, api->KernelContext_GetOutputCount(ctx, &n));
  if (n < 2) return;
  const int64_t dims[1] = {0};
  OrtValue* v = nullptr;  // null when the node names no second output ("")
  check(api, api->KernelContext_GetOutput(ctx, 1, dims, 1, &v));
}

// Returns false when the attribute is absent.
bool attr_string(const OrtApi* api, const OrtKernelInfo* info, const char* name,
                 std::string* out) {
  size_t size = 0;
  OrtStatus* st = api->KernelInfoGetAttribute_string(info, name, nullptr, &size);
  if (st != nullptr) {
    api->ReleaseStatus(st);
    return false;
  }
  std::string s(size, '\0');
  check(api, api->KernelInfoGetAttribute_string(info, name, s.data(), &size));
  s.resize(std::strlen(s.c_str()));
  *out = std::move(s);
  return true;
}

bool attr_int(const OrtApi* api, const OrtKernelInfo* info, const char* name, int64_t* out) {
  OrtStatus* st = api->KernelInfoGetAttribute_int64(info, name, out);
  if (st != nullptr) {
    api->ReleaseStatus(st);
    return false;
  }
  return true;
}

bool attr_ints(const OrtApi* api, const OrtKernelInfo* info, const char* name,
               std::vector<int64_t>* out) {
  size_t size = 0;
  OrtStatus* st = api->KernelInfoGetAttributeArray_int64(info, name, nullptr, &size);
  if (st != nullptr) {
    api->ReleaseStatus(st);
    return false;
  }
  out->assign(size, 0);
  if (size != 0) check(api, api->KernelInfoGetAttributeArray_int64(info, name, out->data(), &size));
  return true;
}

// A token holds [id, tag] (StoreKey): 16 bytes whatever its element type.
StoreKey read_token(const OrtApi* api, const OrtValue* v, int bits) {
  const TensorInfo ti = tensor_info(api, v);
  if (byte_size(ti.numel, bits) != kTokenBytes) {
    fail(ORT_INVALID_ARGUMENT, "token input is not a 16-byte Store token");
  }
  StoreKey t{};
  std::memcpy(&t.id, tensor_data(api, v), sizeof(t.id));
  std::memcpy(&t.tag, static_cast<const char*>(tensor_data(api, v)) + 8, sizeof(t.tag));
  return t;
}

void write_token(void* dst, const StoreKey& k) {
  std::memcpy(dst, &k.id, sizeof(k.id));
  std::memcpy(static_cast<char*>(dst) + 8, &k.tag, sizeof(k.tag));
}

// Bytes of a stored tensor's shape, checked: the reload's output must be exactly the bytes
// the Store copied (never an overflow, never a partly written output).
void check_stored(const StoredTensor& rec, ONNXTensorElementDataType want, int bits) {
  if (rec.elem_type() != want) {
    fail(ORT_INVALID_ARGUMENT,
         "the stored tensor has element type " + std::to_string(static_cast<int>(rec.elem_type())) +
             " but this Prefetch reloads element type " + std::to_string(static_cast<int>(want)) +
             " (the token comes from a Store of another type)");
  }
  uint64_t numel = 1;
  for (int64_t d : rec.shape()) {
    if (d < 0) fail(ORT_INVALID_ARGUMENT, "stored tensor has a negative dimension");
    if (d != 0 && numel > UINT64_MAX / 8 / static_cast<uint64_t>(d)) {
      fail(ORT_INVALID_ARGUMENT, "stored tensor shape overflows");
    }
    numel *= static_cast<uint64_t>(d);
  }
  if (byte_size(numel, bits) != rec.bytes()) {
    fail(ORT_INVALID_ARGUMENT, "stored tensor holds " + std::to_string(rec.bytes()) +
                                   " bytes but its shape needs " +
                                   std::to_string(byte_size(numel, bits)));
  }
}

// ---------------------------------------------------------------------------------------
// Kernels.

struct Kernel {
  ~Kernel() {
    if (alloc != nullptr) api->ReleaseAllocator(alloc);
  }
  const OrtApi* api;
  OpKind kind;
  int bits;
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  bool gpu = false;  // CUDA EP: buffers are device memory, the engine orders by streams
  int device = 0;
  std::string node;  // the node's name, for messages
  std::shared_ptr<Engine> engine;
  // The kernel's identity for the engine's run tracking (ExecContext::kernel): a serial
  // number, never an address. A freed kernel's address can come back as a later session's
  // kernel while the thread's run epoch still lists it, which made the CPU engine take a
  // new run for the same run and drop its pending stores ("no pending store of this run").
  const void* identity = next_identity();
  static const void* next_identity() {
    static std::atomic<uintptr_t> next{1};
    return reinterpret_cast<const void*>(next.fetch_add(1));
  }
  // Wait: the kernel's default allocator (ORT's arena of its EP), sampled at every Wait.
  OrtAllocator* alloc = nullptr;
  const StatsApi* stats = nullptr;

  // Prefetch of a weight (attribute `location` present).
  bool weight = false;
  std::vector<int64_t> shape;
  std::shared_ptr<const HostBlob> blob;        // host tier: bytes read at session creation
  std::shared_ptr<const DiskSource> disk;      // disk tier: read from the file at every run

  void compute(OrtKernelContext* ctx);
  void compute_gpu(OrtKernelContext* ctx);
  void init_weight(const OpDef& op, const OrtKernelInfo* info, const std::string& location);
};

void Kernel::init_weight(const OpDef& op, const OrtKernelInfo* info,
                         const std::string& location) {
  std::string name;
  if (!attr_string(api, info, "name", &name) || name.empty()) {
    name = "?";
    size_t size = 0;  // fall back on the node's name
    OrtStatus* st = api->KernelInfo_GetNodeName(info, nullptr, &size);
    if (st != nullptr) {
      api->ReleaseStatus(st);
    } else if (size > 1) {
      std::string node(size, '\0');
      check(api, api->KernelInfo_GetNodeName(info, node.data(), &size));
      node.resize(std::strlen(node.c_str()));
      name = "? (node '" + node + "')";
    }
  }
  const std::string who = "ho_onnx Prefetch of weight '" + name + "' (location '" + location + "')";
  auto bad = [&](OrtErrorCode code, const std::string& what) {
    fail(code, who + ": " + what);
  };

  std::string tier = "host";  // absent: the host store
  if (attr_string(api, info, "tier", &tier) && tier != "host" && tier != "disk") {
    bad(ORT_INVALID_ARGUMENT, "unknown tier '" + tier + "' (host or disk)");
  }

  int64_t offset = 0;
  int64_t length = 0;
  if (!attr_int(api, info, "offset", &offset)) bad(ORT_INVALID_ARGUMENT, "attribute 'offset' missing");
  if (!attr_int(api, info, "length", &length)) bad(ORT_INVALID_ARGUMENT, "attribute 'length' missing");
  if (!attr_ints(api, info, "shape", &shape)) bad(ORT_INVALID_ARGUMENT, "attribute 'shape' missing");

  uint64_t numel = 1;
  for (int64_t d : shape) {
    if (d < 0) bad(ORT_INVALID_ARGUMENT, "negative dimension in 'shape'");
    numel *= static_cast<uint64_t>(d);
  }
  if (offset < 0) bad(ORT_INVALID_ARGUMENT, "negative offset " + std::to_string(offset));
  if (length < 0) bad(ORT_INVALID_ARGUMENT, "negative length " + std::to_string(length));
  const size_t expect = byte_size(numel, op.bits);
  if (static_cast<uint64_t>(length) != expect) {
    bad(ORT_INVALID_ARGUMENT, "length " + std::to_string(length) + " does not match shape (" +
                                  std::to_string(expect) + " bytes expected)");
  }

  // Resolved only inside the session's model folder: the node's `base_dir` (an absolute
  // path written by the rewriter) is never used.
  const std::string& dir = op.reg->model_dir;
  if (dir.empty()) {
    bad(ORT_INVALID_ARGUMENT,
        std::string("the model has offloaded weights but no model directory is known: set the "
                    "session config entry '") +
            kModelDirKey +
            "' to the folder of the model file (ho_onnx.runtime.session_options(model_path) "
            "does; a model given as bytes needs it set explicitly)");
  }
  std::shared_ptr<WeightFile> file;
  try {
    file = resolve_weight_file(dir, location);
  } catch (const Error& e) {
    bad(e.code(), e.what());
  }
  const uint64_t file_size = file->size();
  int64_t want_size = -1;
  if (attr_int(api, info, "data_size", &want_size) && want_size >= 0 &&
      static_cast<uint64_t>(want_size) != file_size) {
    bad(ORT_INVALID_ARGUMENT, "'" + file->path() + "' has " + std::to_string(file_size) +
                                  " bytes but the model was optimized for a data file of " +
                                  std::to_string(want_size) +
                                  " bytes (not the data file this model was written with)");
  }
  std::string want_fp;
  if (attr_string(api, info, "data_fingerprint", &want_fp) && !want_fp.empty()) {
    const std::string fp = op.reg->fingerprint(*file);
    if (fp != want_fp) {
      bad(ORT_INVALID_ARGUMENT, "'" + file->path() + "' has fingerprint " + fp +
                                    " but the model was optimized for " + want_fp +
                                    " (not the data file this model was written with)");
    }
  }
  if (static_cast<uint64_t>(offset) > file_size ||
      static_cast<uint64_t>(length) > file_size - static_cast<uint64_t>(offset)) {
    bad(ORT_INVALID_ARGUMENT, "offset " + std::to_string(offset) + " + length " +
                                  std::to_string(length) + " is past the end of '" +
                                  file->path() + "' (" + std::to_string(file_size) + " bytes)");
  }
  try {
    if (tier == "disk") {
      disk = engine->open_disk_weight(file, offset, length, name);
    } else {
      blob = engine->load_weight(*file, offset, length);
    }
  } catch (const Error& e) {
    bad(e.code(), e.what());
  }
}

void Kernel::compute(OrtKernelContext* ctx) {
  if (gpu) return compute_gpu(ctx);
  ExecContext ec{};
  ec.kernel = identity;
  ec.api = api;
  ec.kctx = ctx;
  switch (kind) {
    case OpKind::kPrefetch: {
      if (weight) {
        OrtValue* y = output(api, ctx, shape);
        if (disk) {
          engine->prefetch_disk(disk, disk->size() ? tensor_data(api, y) : nullptr, ec);
        } else {
          engine->prefetch_weight(blob, blob->size() ? tensor_data(api, y) : nullptr, ec);
        }
        produce_issued(api, ctx);
        return;
      }
      const StoreKey t = read_token(api, input(api, ctx, 0), bits);
      std::shared_ptr<StoredTensor> rec = engine->take_stored(t, ec);
      check_stored(*rec, type, bits);
      OrtValue* y = output(api, ctx, rec->shape());
      void* dst = rec->bytes() ? tensor_data(api, y) : nullptr;
      engine->prefetch_stored(std::move(rec), dst, ec);
      produce_issued(api, ctx);
      return;
    }
    case OpKind::kWait: {
      const OrtValue* y = input(api, ctx, 0);
      const TensorInfo ti = tensor_info(api, y);
      const size_t bytes = byte_size(ti.numel, bits);
      OrtValue* z = output(api, ctx, ti.dims);
      if (bytes == 0) return;
      const void* src = tensor_data(api, y);
      void* dst = tensor_data(api, z);
      // The engine copies from its own memory into z (= y when ORT aliased them).
      engine->wait(src, dst, bytes, ec);
      if (dst != src) counters().alias_copies += 1;
      if (stats != nullptr) sample_arena(*stats, api, alloc);
      return;
    }
    case OpKind::kStore: {
      const OrtValue* x = input(api, ctx, 0);
      const TensorInfo ti = tensor_info(api, x);
      const size_t bytes = byte_size(ti.numel, bits);
      const std::vector<int64_t> token_dims{static_cast<int64_t>((128 + bits - 1) / bits)};
      OrtValue* tok = output(api, ctx, token_dims);
      const StoreKey key =
          engine->store(bytes ? tensor_data(api, x) : nullptr, bytes, ti.dims, type, ec);
      write_token(tensor_data(api, tok), key);
      return;
    }
    case OpKind::kDetach: {
      const OrtValue* tok = input(api, ctx, 1);
      const StoreKey t = read_token(api, tok, bits);
      const TensorInfo ti = tensor_info(api, tok);
      OrtValue* tok2 = output(api, ctx, ti.dims);
      engine->detach(t, ec);
      void* dst = tensor_data(api, tok2);
      const void* src = tensor_data(api, tok);
      if (dst != src) {
        std::memcpy(dst, src, kTokenBytes);
        counters().alias_copies += 1;
      }
      return;
    }
  }
}

OrtStatus* to_status(const OrtApi* api, OpKind kind, const std::string& node, const char* what,
                     OrtErrorCode code) {
  std::string msg = what;
  const std::string prefix = "ho_onnx";
  if (msg.compare(0, prefix.size(), prefix) != 0) {
    msg = "ho_onnx " + std::string(op_name(kind)) +
          (node.empty() ? std::string() : " (node '" + node + "')") + ": " + msg;
  }
  return api->CreateStatus(code, msg.c_str());
}

// Runs `body` and turns every C++ exception into an OrtStatus: nothing crosses the ABI.
template <typename Body>
OrtStatus* guarded(const OrtApi* api, OpKind kind, const std::string& node, Body&& body) noexcept {
  try {
    body();
    return nullptr;
  } catch (const Error& e) {
    return to_status(api, kind, node, e.what(), e.code());
  } catch (const std::exception& e) {
    return to_status(api, kind, node, e.what(), ORT_FAIL);
  } catch (...) {
    return to_status(api, kind, node, "unknown C++ exception", ORT_FAIL);
  }
}

std::string node_name(const OrtApi* api, const OrtKernelInfo* info) {
  size_t size = 0;
  OrtStatus* st = api->KernelInfo_GetNodeName(info, nullptr, &size);
  if (st != nullptr) {
    api->ReleaseStatus(st);
    return {};
  }
  std::string node(size, '\0');
  st = api->KernelInfo_GetNodeName(info, node.data(), &size);
  if (st != nullptr) {
    api->ReleaseStatus(st);
    return {};
  }
  node.resize(std::strlen(node.c_str()));
  return node;
}

// The device of a CUDA-EP kernel: the id of its default allocator's memory info.
int kernel_device(const OrtApi* api, const OrtKernelInfo* info) {
  OrtAllocator* alloc = nullptr;
  check(api, api->KernelInfoGetAllocator(info, OrtMemTypeDefault, &alloc));
  std::unique_ptr<OrtAllocator, void (*)(OrtAllocator*)> owned(alloc, api->ReleaseAllocator);
  const OrtMemoryInfo* mi = nullptr;
  check(api, api->AllocatorGetInfo(alloc, &mi));
  int id = 0;
  check(api, api->MemoryInfoGetId(mi, &id));
  return id;
}

// GPU EP: no kernel reads device memory on the host. Tokens are named by their device
// address; the engine writes tokens and does the un-aliased output copies on the stream.
void Kernel::compute_gpu(OrtKernelContext* ctx) {
  ExecContext ec{};
  ec.device = device;
  ec.kernel = identity;
  check(api, api->KernelContext_GetGPUComputeStream(ctx, &ec.stream));
  // The header allows a null stream ("not relevant" for the kernel's EP). Every ordering of
  // the engine is an event edge with ORT's compute stream; substituting the legacy default
  // stream would silently change what those edges order against, so refuse instead.
  if (ec.stream == nullptr) {
    fail(ORT_EP_FAIL, "ORT gave this CUDA-EP kernel no GPU compute stream "
                      "(KernelContext_GetGPUComputeStream returned null); the CUDA engine "
                      "orders its copies only against that stream");
  }
  cuda_set_device(device);  // ORT's thread may have another device current
  switch (kind) {
    case OpKind::kPrefetch: {
      if (weight) {
        OrtValue* y = output(api, ctx, shape);
        if (disk) {
          engine->prefetch_disk(disk, disk->size() ? tensor_data(api, y) : nullptr, ec);
        } else {
          engine->prefetch_weight(blob, blob->size() ? tensor_data(api, y) : nullptr, ec);
        }
        produce_issued(api, ctx);
        return;
      }
      StoreKey key;
      key.id = reinterpret_cast<uintptr_t>(tensor_data(api, input(api, ctx, 0)));
      std::shared_ptr<StoredTensor> rec = engine->take_stored(key, ec);
      check_stored(*rec, type, bits);
      OrtValue* y = output(api, ctx, rec->shape());
      void* dst = rec->bytes() ? tensor_data(api, y) : nullptr;
      engine->prefetch_stored(std::move(rec), dst, ec);
      produce_issued(api, ctx);
      return;
    }
    case OpKind::kWait: {
      const OrtValue* y = input(api, ctx, 0);
      const TensorInfo ti = tensor_info(api, y);
      const size_t bytes = byte_size(ti.numel, bits);
      OrtValue* z = output(api, ctx, ti.dims);
      if (bytes == 0) return;
      ec.out = tensor_data(api, z);
      engine->wait(tensor_data(api, y), ec.out, bytes, ec);
      if (stats != nullptr) sample_arena(*stats, api, alloc);
      return;
    }
    case OpKind::kStore: {
      const OrtValue* x = input(api, ctx, 0);
      const TensorInfo ti = tensor_info(api, x);
      const size_t bytes = byte_size(ti.numel, bits);
      const std::vector<int64_t> token_dims{static_cast<int64_t>((128 + bits - 1) / bits)};
      ec.out = tensor_data(api, output(api, ctx, token_dims));
      engine->store(bytes ? tensor_data(api, x) : nullptr, bytes, ti.dims, type, ec);
      return;
    }
    case OpKind::kDetach: {
      const OrtValue* tok = input(api, ctx, 1);
      const TensorInfo ti = tensor_info(api, tok);
      if (byte_size(ti.numel, bits) != kTokenBytes) {
        fail(ORT_INVALID_ARGUMENT, "token input is not a 16-byte Store token");
      }
      ec.out = tensor_data(api, output(api, ctx, ti.dims));
      StoreKey key;
      key.id = reinterpret_cast<uintptr_t>(tensor_data(api, tok));
      engine->detach(key, ec);
      return;
    }
  }
}

// ---------------------------------------------------------------------------------------
// OrtCustomOp callbacks.

OrtStatusPtr ORT_API_CALL create_kernel(const OrtCustomOp* op, const OrtApi* api,
                                        const OrtKernelInfo* info, void** kernel) {
  const OpDef& d = *def(op);
  *kernel = nullptr;
  const std::string node = node_name(api, info);
  return guarded(api, d.kind, node, [&] {
    auto k = std::make_unique<Kernel>();
    k->api = api;
    k->kind = d.kind;
    k->bits = d.bits;
    k->type = d.type;
    k->gpu = d.cuda;
    k->node = node;
    k->engine = d.reg->acquire_engine(d.cuda);
    if (k->gpu) {
      k->device = kernel_device(api, info);
      cuda_set_device(k->device);
    }
    if (d.kind == OpKind::kWait && d.reg->stats.ok()) {
      OrtStatus* st = api->KernelInfoGetAllocator(info, OrtMemTypeDefault, &k->alloc);
      if (st != nullptr) {  // no statistics then; never a reason to fail the session
        api->ReleaseStatus(st);
        k->alloc = nullptr;
      } else {
        k->stats = &d.reg->stats;
      }
    }
    std::string location;
    if (d.kind == OpKind::kPrefetch && attr_string(api, info, "location", &location)) {
      k->weight = true;
      k->init_weight(d, info, location);
    }
    if (k->gpu) {
      if (d.kind == OpKind::kStore) {
        int64_t host_bytes = d.reg->host_bytes;
        if (host_bytes < 0) attr_int(api, info, kHostBytesAttr, &host_bytes);
        if (host_bytes > 0) k->engine->plan_host_bytes(static_cast<size_t>(host_bytes));
      }
      k->engine->prepare_device(k->device);  // streams, events, staging: not on a run
    }
    *kernel = k.release();
  });
}

OrtStatusPtr ORT_API_CALL compute_kernel(void* kernel, OrtKernelContext* ctx) {
  auto* k = static_cast<Kernel*>(kernel);
  return guarded(k->api, k->kind, k->node, [&] {
    k->compute(ctx);
    (k->gpu ? counters().ops_cuda : counters().ops_cpu) += 1;
  });
}

void ORT_API_CALL destroy_kernel(void* kernel) noexcept {
  delete static_cast<Kernel*>(kernel);
}

const char* ORT_API_CALL get_name(const OrtCustomOp* op) { return op_name(def(op)->kind); }

const char* ORT_API_CALL get_ep(const OrtCustomOp* op) { return def(op)->cuda ? kCudaEp : kCpuEp; }

size_t ORT_API_CALL input_count(const OrtCustomOp* op) { return fixed_inputs(def(op)->kind) + 1; }

ONNXTensorElementDataType ORT_API_CALL input_type(const OrtCustomOp* op, size_t i) {
  return i < fixed_inputs(def(op)->kind) ? def(op)->type : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
}

OrtCustomOpInputOutputCharacteristic ORT_API_CALL input_char(const OrtCustomOp* op, size_t i) {
  return i < fixed_inputs(def(op)->kind) ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_VARIADIC;
}

// Prefetch: (y, issued optional); the others: one output.
size_t ORT_API_CALL output_count(const OrtCustomOp* op) {
  return def(op)->kind == OpKind::kPrefetch ? 2 : 1;
}

ONNXTensorElementDataType ORT_API_CALL output_type(const OrtCustomOp* op, size_t) {
  return def(op)->type;
}

// Optional outputs came with OrtCustomOp version 8 (ORT's custom_ops.cc:
// min_ort_version_with_optional_io_support), below the API version 18 the ops declare.
OrtCustomOpInputOutputCharacteristic ORT_API_CALL output_char(const OrtCustomOp*, size_t i) {
  return i == 0 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
}

OrtMemType ORT_API_CALL input_mem_type(const OrtCustomOp*, size_t) { return OrtMemTypeDefault; }

int ORT_API_CALL variadic_in_min_arity(const OrtCustomOp*) { return 0; }
int ORT_API_CALL variadic_in_homogeneity(const OrtCustomOp*) { return 0; }
int ORT_API_CALL variadic_out_min_arity(const OrtCustomOp*) { return 1; }
int ORT_API_CALL variadic_out_homogeneity(const OrtCustomOp*) { return 0; }

int ORT_API_CALL start_version(const OrtCustomOp*) { return 1; }
int ORT_API_CALL end_version(const OrtCustomOp*) { return INT_MAX; }

// GetAliasMap has no op argument: one pair of functions per aliasing op.
template <int kIn>
size_t ORT_API_CALL alias_map(int** input_index, int** output_index) {
  *input_index = new int[1]{kIn};
  *output_index = new int[1]{0};
  return 1;
}

void ORT_API_CALL release_alias_map(int* input_index, int* output_index) {
  delete[] input_index;
  delete[] output_index;
}

std::unique_ptr<OpDef> make_op(Registration* reg, OpKind kind, const ElemType& t, bool cuda) {
  auto op = std::make_unique<OpDef>();
  std::memset(static_cast<OrtCustomOp*>(op.get()), 0, sizeof(OrtCustomOp));
  op->version = kOrtApiVersion;  // ORT hands CreateKernelV2 GetApi(op->version)
  op->CreateKernel = nullptr;  // V2 only
  op->GetName = get_name;
  op->GetExecutionProviderType = get_ep;
  op->GetInputType = input_type;
  op->GetInputTypeCount = input_count;
  op->GetOutputType = output_type;
  op->GetOutputTypeCount = output_count;
  op->KernelCompute = nullptr;  // V2 only
  op->KernelDestroy = destroy_kernel;
  op->GetInputCharacteristic = input_char;
  op->GetOutputCharacteristic = output_char;
  op->GetInputMemoryType = input_mem_type;
  op->GetVariadicInputMinArity = variadic_in_min_arity;
  op->GetVariadicInputHomogeneity = variadic_in_homogeneity;
  op->GetVariadicOutputMinArity = variadic_out_min_arity;
  op->GetVariadicOutputHomogeneity = variadic_out_homogeneity;
  op->CreateKernelV2 = create_kernel;
  op->KernelComputeV2 = compute_kernel;
  op->InferOutputShapeFn = nullptr;
  op->GetStartVersion = start_version;
  op->GetEndVersion = end_version;
  op->GetMayInplace = nullptr;
  op->ReleaseMayInplace = nullptr;
  if (kind == OpKind::kWait) {
    op->GetAliasMap = alias_map<0>;
    op->ReleaseAliasMap = release_alias_map;
  } else if (kind == OpKind::kDetach) {
    op->GetAliasMap = alias_map<1>;
    op->ReleaseAliasMap = release_alias_map;
  }
  op->kind = kind;
  op->type = t.type;
  op->bits = t.bits;
  op->cuda = cuda;
  op->reg = reg;
  return op;
}

std::string config_entry(const OrtApi* api, const OrtSessionOptions* options, const char* key,
                         bool* found) {
  int has = 0;
  check(api, api->HasSessionConfigEntry(options, key, &has));
  *found = has != 0;
  if (!has) return {};
  size_t size = 0;
  check(api, api->GetSessionConfigEntry(options, key, nullptr, &size));
  std::string v(size, '\0');
  check(api, api->GetSessionConfigEntry(options, key, v.data(), &size));
  v.resize(std::strlen(v.c_str()));
  return v;
}

// Whether to register the CUDA-EP variants: a CUDA build, and the runtime has the CUDA
// execution provider (or HO_ONNX_CUDA_OPS=1 forces them, =0 leaves them out).
bool want_cuda_ops(const OrtApi* api) {
#if HO_ONNX_WITH_CUDA
  const char* env = std::getenv("HO_ONNX_CUDA_OPS");
  if (env != nullptr && std::strcmp(env, "0") == 0) return false;
  if (env != nullptr && std::strcmp(env, "1") == 0) return true;
  char** providers = nullptr;
  int n = 0;
  check(api, api->GetAvailableProviders(&providers, &n));
  bool found = false;
  for (int i = 0; i < n; ++i) {
    if (std::strcmp(providers[i], kCudaEp) == 0) found = true;
  }
  check(api, api->ReleaseAvailableProviders(providers, n));
  return found;
#else
  (void)api;
  return false;
#endif
}

// (major, minor) of a runtime version string such as "1.21.1"; (0, 0) when unparsable.
std::pair<int, int> runtime_version(const char* v) {
  int major = 0, minor = 0;
  if (v == nullptr || std::sscanf(v, "%d.%d", &major, &minor) != 2) return {0, 0};
  return {major, minor};
}

// Whether the runtime knows element type `t`. ORT refuses every session when an op of the
// library declares a type the runtime lacks ("tensor type N is not supported"), so types
// newer than the runtime are not registered (a model using them would not load without
// ho-onnx either). Measured with the onnxruntime wheels: INT4/UINT4 from 1.19, FLOAT4E2M1
// (type 23) from 1.24; every other type of elem_types() is in 1.18.
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

OrtStatus* register_ops(OrtSessionOptions* options, const OrtApi* api, const OrtApiBase* base) {
  const std::pair<int, int> rt = runtime_version(base->GetVersionString());
  auto reg = std::make_unique<Registration>();
  reg->api = api;
  reg->stats = resolve_stats_api(base, rt);

  bool has = false;
  std::string v = config_entry(api, options, kModelDirKey, &has);
  if (has) reg->model_dir = v;
  {
    const long pages = ::sysconf(_SC_PHYS_PAGES);
    const long page = ::sysconf(_SC_PAGESIZE);
    reg->limits.host_pool_limit =
        pages > 0 && page > 0 ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) / 2 : 0;
  }
  v = config_entry(api, options, kPoolLimitKey, &has);
  if (has) {
    char* end = nullptr;
    const unsigned long long x = std::strtoull(v.c_str(), &end, 10);
    if (v.empty() || *end != '\0' || v[0] == '-' || x == 0) {
      fail(ORT_INVALID_ARGUMENT, std::string("session config entry '") + kPoolLimitKey +
                                     "' must be a positive byte count, got '" + v + "'");
    }
    reg->limits.host_pool_limit = x;
  }
  v = config_entry(api, options, kHostBytesKey, &has);
  if (has) {
    char* end = nullptr;
    const long long x = std::strtoll(v.c_str(), &end, 10);
    if (v.empty() || *end != '\0' || x < 0) {
      fail(ORT_INVALID_ARGUMENT, std::string("session config entry '") + kHostBytesKey +
                                     "' must be a byte count, got '" + v + "'");
    }
    reg->host_bytes = x;
  }

  const bool cuda = want_cuda_ops(api);
  const std::string key = std::to_string(reinterpret_cast<uintptr_t>(api)) + '\n' +
                          reg->model_dir + '\n' + std::to_string(reg->host_bytes) + '\n' +
                          std::to_string(reg->limits.host_pool_limit) + '\n' +
                          (cuda ? "cuda" : "cpu");
  std::lock_guard<std::mutex> lock(g_regs_mu);
  auto found = g_regs->find(key);
  if (found != g_regs->end()) {
    check(api, api->AddCustomOpDomain(options, found->second->domain));
    counters().registrations += 1;
    if (cuda) counters().cuda_registrations += 1;
    return nullptr;
  }
  OrtCustomOpDomain* domain = nullptr;
  check(api, api->CreateCustomOpDomain(kDomain, &domain));
  reg->domain = domain;
  reg->cuda = cuda;
  for (bool on_cuda : {false, true}) {
    if (on_cuda && !cuda) continue;
    for (OpKind kind : {OpKind::kPrefetch, OpKind::kWait, OpKind::kStore, OpKind::kDetach}) {
      for (const ElemType* t = elem_types(); t->bits != 0; ++t) {
        if (!runtime_has_type(t->type, rt)) continue;
        reg->ops.push_back(make_op(reg.get(), kind, *t, on_cuda));
        check(api, api->CustomOpDomain_Add(domain, reg->ops.back().get()));
      }
    }
  }
  // Kept before AddCustomOpDomain: once ORT holds the domain it must never be freed.
  g_regs->emplace(key, reg.release());
  check(api, api->AddCustomOpDomain(options, domain));
  counters().registrations += 1;
  if (cuda) counters().cuda_registrations += 1;
  return nullptr;
}

}  // namespace
}  // namespace ho

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  if (api_base == nullptr) return nullptr;
  const OrtApi* api = api_base->GetApi(ho::kOrtApiVersion);
  if (api == nullptr) {
    // The runtime is older than that; API 1 still has CreateStatus.
    const OrtApi* v1 = api_base->GetApi(1);
    const char* have = api_base->GetVersionString();
    return v1 == nullptr
               ? nullptr
               : v1->CreateStatus(ORT_FAIL, (std::string("ho_onnx needs ONNX Runtime API version ") +
                                             std::to_string(ho::kOrtApiVersion) +
                                             " (onnxruntime >= " HO_ONNX_ORT_MIN_VERSION
                                             "), this runtime is " +
                                             (have ? have : "?"))
                                                .c_str());
  }
  try {
    return ho::register_ops(options, api, api_base);
  } catch (const ho::Error& e) {
    return api->CreateStatus(e.code(), (std::string("ho_onnx RegisterCustomOps: ") + e.what()).c_str());
  } catch (const std::exception& e) {
    return api->CreateStatus(ORT_FAIL, (std::string("ho_onnx RegisterCustomOps: ") + e.what()).c_str());
  } catch (...) {
    return api->CreateStatus(ORT_FAIL, "ho_onnx RegisterCustomOps: unknown C++ exception");
  }
}
