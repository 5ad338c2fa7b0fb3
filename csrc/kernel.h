// The kernel of one node of an op (Prefetch, Wait, Store, Detach) on the CPU or the CUDA
// execution provider: set up at session creation (kernel.cc: create, init_weight), run at
// every Compute. Kernels call into their registration's Engine (engine.h).
#pragma once

#include <onnxruntime_c_api.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine.h"
#include "ort_tensor.h"
#include "ort_abi.h"
#include "registration.h"
#include "routing.h"
#include "tiers.h"

namespace ho {

struct Kernel {
  // The kernel of node `node` for the op `op` (session creation).
  static std::unique_ptr<Kernel> create(const OpDef& op, const OrtApi* api,
                                        const OrtKernelInfo* info, const std::string& node);
  ~Kernel() {
    if (alloc != nullptr) api->ReleaseAllocator(alloc);
    if (matmul != nullptr) api->ReleaseOp(matmul);
    if (weight_value != nullptr) api->ReleaseValue(weight_value);
    expert_cache.reset();  // (before forget_kernel: the engine drops a group none holds)
    if (engine && engine->forked_away()) {
      abandon_engine(std::move(engine));
    } else if (engine) {
      engine->forget_kernel(identity);  // its session is gone: so are its runs
    }
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
  // How a token input names its store (ort_tensor.h): read_token on the CPU EP,
  // token_address on the CUDA EP (the token is in device memory).
  StoreKey (*token_key)(const OrtApi*, const OrtValue*, int bits) = nullptr;
  // Wait with ho_onnx.sample_arena=1: the kernel's default allocator (ORT's arena of its
  // EP), sampled at every Wait. Null otherwise.
  OrtAllocator* alloc = nullptr;
  const StatsApi* stats = nullptr;

  // Store: the shape of its token output (16 bytes of T), fixed at session creation.
  std::vector<int64_t> token_dims;

  // Guard: the dims of its input the plan holds for, each within [lo, hi] (the model's
  // ho_onnx.dim_ranges); a run outside them is refused before it overruns the plan.
  struct DimRange {
    int64_t axis, lo, hi;
    std::string name;
  };
  std::vector<DimRange> ranges;
  std::string input_name;  // the graph input it reads (messages)
  // Guard of a plan with a decode cache (attributes cache_group, cache_points, cache_bytes):
  // per point of the plan, the values of this Guard's dims there (`cache_points`, a row per
  // point) and the bytes the plan leaves for the cache at that point (`cache_bytes`). A run
  // may use the bytes of a point that covers every dim of every Guard of the run (each
  // Guard narrows the run's set of points: at most 64), the most of them; the Guard limits
  // the group's caches to that (Engine::limit_cache_group).
  std::vector<std::vector<int64_t>> cache_points;
  std::vector<int64_t> cache_bytes;
  std::vector<int64_t> cache_ahead;  // (read-ahead bytes per point)
  int64_t cache_guards = 1;          // (the group's Guards: the run's last one limits)

  // Prefetch and Wait with attribute `gated` = 1: input 1 is the gate, a routed value that
  // is empty when no token reaches the reader (an expert no token was routed to). An empty
  // gate skips the transfer: the Prefetch starts none, the Wait copies nothing and its
  // output's bytes are unspecified (the reader reads none of them). Only the gate's shape
  // is read, never its data (on the CUDA EP it is device memory).
  bool gated = false;
  // Attribute `iteration` = 1: the op is inside a Loop/Scan body and executes once per
  // iteration; its records live for one iteration (Engine::enter_run).
  bool per_iteration = false;
  // A gated weight Prefetch with attribute `route` ("softmax": MoE, "topk": QMoE) and
  // `route_k` (the op's k): its gate is the MoE op's router input [tokens, E] and the weight
  // is stacked by expert on axis 0 (shape[0] = E); only the experts the op will select move
  // (routing.h; on the CPU EP; on the CUDA EP the whole weight moves).
  RouteMode route = RouteMode::kNone;
  int64_t route_k = 0;

  // Prefetch of a weight (attribute `location` present).
  bool weight = false;
  std::vector<int64_t> shape;
  // Its bytes, by its tier's movement (tiers.h): in the engine's host store (host), or read
  // from its source at every run (disk).
  std::shared_ptr<const HostBlob> blob;
  std::shared_ptr<const WeightSource> streamed;
  // A streamed weight with attribute `expert_cache` > 0: its data file's expert cache
  // (Engine::expert_cache; null: none, or an engine without one) and its key there.
  std::shared_ptr<ExpertCacheBase> expert_cache;
  std::string cache_key;
  // Attribute `cache_group` (not 0): the plan's decode cache (a Guard's and its cached
  // Prefetches'); such a Prefetch's miss is kept only where it fits (no eviction), and with
  // `cache_order` (its place among the group's reads) it reads the next ones ahead.
  uint64_t cache_group = 0;
  int64_t cache_order = -1;
  // A cached Prefetch with attribute `warm` = 1 (a speculation of the next layer's router):
  // it starts the weight's read into the expert cache when its gate, the int64 indices a
  // router picked, holds `warm_expert`; its output is empty. A no-op on the CUDA EP (no
  // device-memory cache) and without a cache.
  bool warm = false;
  int64_t warm_expert = -1;
  size_t row_bytes = 0;  // GatherRows: bytes of one row of the table (fixed at creation)
  // HostMatMul: ORT's own CPU MatMul kernel (CreateOp) and the weight as an OrtValue over
  // the host store's bytes (no copy; `blob` keeps them alive), both made at creation.
  OrtOp* matmul = nullptr;
  OrtValue* weight_value = nullptr;

  void compute(OrtKernelContext* ctx);

 private:
  void init_weight(const OpDef& op, const OrtKernelInfo* info, const std::string& location);
  void init_expert_cache(const OrtKernelInfo* info, const WeightSource& src,
                         const std::string& content);
  void init_arena_sampling(const OpDef& op, const OrtKernelInfo* info);
  void init_guard(const OrtKernelInfo* info);
  void init_guard_cache(const OrtKernelInfo* info);
  void limit_cache(uint64_t epoch, const TensorInfo& ti);
  void init_host_matmul(const OrtKernelInfo* info);
  void host_matmul(OrtKernelContext* ctx);
  void guard(OrtKernelContext* ctx, uint64_t epoch);
  void fence(OrtKernelContext* ctx, ExecContext& ec);
  ExecContext cpu_context(OrtKernelContext* ctx) const;
  ExecContext gpu_context(OrtKernelContext* ctx) const;
  void prefetch_weight(OrtKernelContext* ctx, const ExecContext& ec);
  void init_warm(const OrtKernelInfo* info);
  void warm_weight(OrtKernelContext* ctx);
  void prefetch_stored(OrtKernelContext* ctx, const ExecContext& ec);
  void prefetch_input(OrtKernelContext* ctx, const ExecContext& ec);
  bool gate_closed(OrtKernelContext* ctx) const;
  void init_route(const OrtKernelInfo* info);
  bool prefetch_routed(OrtKernelContext* ctx, const ExecContext& ec);
  void emit(OrtKernelContext* ctx, const ExecContext& ec);
  void gather_rows(OrtKernelContext* ctx);
  void wait(OrtKernelContext* ctx, ExecContext& ec);
  void store(OrtKernelContext* ctx, ExecContext& ec);
  void detach(OrtKernelContext* ctx, ExecContext& ec);
};

}  // namespace ho
