// The op domain "ai.hyperoffload" as registered with ORT: the ops (Prefetch, Wait, Store,
// Detach), the session config entries a registration reads, and the Registration that a
// RegisterCustomOps call creates or shares (registration.cc).
#pragma once

#include <onnxruntime_c_api.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine.h"
#include "ort_abi.h"

namespace ho {

class WeightFile;

constexpr const char* kDomain = "ai.hyperoffload";
// Session config entries (README.md, "session config entry").
constexpr const char* kModelDirKey = "ho_onnx.model_dir";
// Bytes of activations the plan stores per run (sizes the CUDA engine's pinned ring at
// session creation). Also a Store attribute of the same meaning: `host_bytes`.
constexpr const char* kHostBytesKey = "ho_onnx.host_bytes";
constexpr const char* kHostBytesAttr = "host_bytes";
// On a streamed weight's Prefetch: the bytes of expert cache its model asks for (kernel.cc).
constexpr const char* kExpertCacheAttr = "expert_cache";
// The decode cache (kernel.h): on its Prefetches and the Guards that limit it per run.
constexpr const char* kCacheGroupAttr = "cache_group";
constexpr const char* kCachePointsAttr = "cache_points";
constexpr const char* kCacheBytesAttr = "cache_bytes";
constexpr const char* kCacheAheadAttr = "cache_ahead";
constexpr const char* kCacheOrderAttr = "cache_order";
constexpr const char* kCacheGuardsAttr = "cache_guards";
// A cached Prefetch with `warm` = 1 only warms the expert cache: when its gate (input 1, the
// int64 expert indices the next layer's router picks from an earlier hidden state) holds
// `expert`, the weight's read into the cache starts; its output is empty.
constexpr const char* kWarmAttr = "warm";
// Any cache op inside a Loop/Scan body: 1 (its records live for one iteration).
constexpr const char* kIterationAttr = "iteration";
constexpr const char* kExpertAttr = "expert";
// Bound of the host pool of stored activations (bytes; default: half the physical memory).
constexpr const char* kPoolLimitKey = "ho_onnx.host_pool_limit_bytes";
// "1": every Wait samples ORT's arena statistics into the ort_arena_* gauges (a string
// key-value map per Wait, so off by default); "0" (default): no sampling.
constexpr const char* kSampleArenaKey = "ho_onnx.sample_arena";

// PrefetchInput: a Prefetch whose source is a tensor the run holds in host memory (a graph
// input: the caller's past KV cache; on the CUDA EP its input 0 is declared CPU memory so
// ORT never copies it to the device whole). Emit: a copy of its input into its output,
// registered for the CPU EP only, so that on the CUDA EP ORT brings the tensor (present KV)
// to host memory right there and frees its device buffer.
// GatherRows: the rows of an offloaded table (axis 0) that int64 ids select, copied from the
// host store into its output (CPU EP only: on the CUDA EP ORT copies the rows to the device,
// never the table); the table's bytes are located like a weight Prefetch's.
// HostMatMul: MatMul(x, W) with W, a 2-D host-tier weight located like a weight Prefetch's,
// read in place from the host store by ORT's own CPU MatMul kernel (CreateOp/InvokeOp);
// CPU EP only: on the CUDA EP ORT moves x to host memory and y back (the activations move,
// never the weight). An empty x does no work.
enum class OpKind { kPrefetch, kWait, kStore, kDetach, kGuard, kPrefetchInput, kEmit,
                    kGatherRows, kHostMatMul, kFence };
const char* op_name(OpKind k);

struct OpDef;

// Registration: the op domain for one library configuration (host bytes, pool limit, arena
// sampling, CUDA variants, and the model directory on runtimes older than 1.24). The
// OrtCustomOpDomain and the op structs must outlive every session options object they were
// added to and every session made from one (ORT keeps raw pointers to them and gives no
// callback when that is over), so registrations are never released; RegisterCustomOps calls
// with the same configuration share one (and so one engine), so a server that creates and
// destroys sessions retains nothing per session. The model directory, the value a server
// varies per tenant or upload, is read by each kernel from its own session's config
// (KernelInfo_GetConfigEntries, onnxruntime >= 1.24): it is not part of the configuration
// there, and distinct folders cost nothing. On older runtimes it is, and the number of
// registrations is bounded (max_registrations(): RegisterCustomOps refuses more, naming the
// cause). The engine, the only large thing, lives and dies with the registration's kernels.
struct Registration {
  const OrtApi* api = nullptr;
  // The folder of this library copy when ho_onnx.config is beside it (registration.cc),
  // else ""; on runtimes older than 1.24 the session config entry takes its place when set
  // (from 1.24 on, kernels read their session's entry first).
  std::string model_dir;
  KernelConfigApi kernel_config;  // ok(): each kernel reads its session's model_dir
  int64_t host_bytes = -1;  // from the session config entry, -1 when not set
  bool sample_arena = false;  // from the session config entry, off when not set
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
  std::string fingerprint(const WeightFile& f, std::string* version = nullptr);
  // What the engines key the bytes of a weight read from `f` by (with its range): the
  // file's identity and version and its fingerprint, so that a file rewritten in place (a
  // model re-optimized while a session lives; an inode reused by the next version) is
  // never served from an earlier version's bytes.
  std::string content_key(const WeightFile& f);
  // The registration's engine of the CPU EP or the CUDA EP, created when none is alive
  // (or when the live one is the parent's, Engine::forked_away: see abandon_engine).
  std::shared_ptr<Engine> acquire_engine(bool on_cuda);
  // The model directory of the session `info` belongs to ("" when not set).
  std::string model_dir_of(const OrtApi* api, const OrtKernelInfo* info) const;
};

// Registrations held by the process (each is never freed), and the most it may hold:
// HO_ONNX_MAX_REGISTRATIONS (1..1000000), default 1024 (~34 KB each).
size_t registrations_held();
size_t max_registrations();

// Keeps `engine` alive for good: an engine made before a fork, in a forked child, must
// never be destroyed there (its destructor would join transfer threads that exist only in
// the parent: found by hand, a child that dropped an inherited session crashed, and one
// that made a new session with disk-tier weights waited forever on the parent's threads).
void abandon_engine(std::shared_ptr<Engine> engine);

// One OrtCustomOp: an op for one element type and execution provider.
struct OpDef : OrtCustomOp {
  OpKind kind;
  ONNXTensorElementDataType type;
  int bits;
  bool cuda;  // registered for the CUDA execution provider
  Registration* reg;
};

}  // namespace ho
