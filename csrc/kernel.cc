// Kernels of the ops: set-up at session creation and Compute. One path per op serves both
// execution providers; where the CUDA EP differs (device memory the host must not read, the
// compute stream) the difference is named next to the code.
#include "kernel.h"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <climits>
#include <cstring>
#include <unordered_map>
#include <utility>

#include "common.h"
#include "ort_tensor.h"
#include "tiers.h"
#include "weight_file.h"
#if HO_ONNX_WITH_CUDA
#include "cuda/cuda_api.h"
#endif

namespace ho {
#if !HO_ONNX_WITH_CUDA
// No CUDA-EP kernel exists in such a build.
inline void cuda_set_device(int) {}
#endif

namespace {

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

// ---- weights: Prefetch with attribute `location` ---------------------------------------

// Failures of one weight's set-up, named by the weight and its location.
struct WeightError {
  std::string who;
  [[noreturn]] void operator()(OrtErrorCode code, const std::string& what) const {
    fail(code, who + ": " + what);
  }
};

// The weight's name for messages: its `name` attribute, else the node's.
std::string weight_name(const OrtApi* api, const OrtKernelInfo* info, const std::string& node) {
  std::string name;
  if (attr_string(api, info, "name", &name) && !name.empty()) return name;
  return node.empty() ? "?" : "? (node '" + node + "')";
}

// The attributes that place a weight in its file: tier, offset, length and shape (into
// `shape`), checked against each other.
struct WeightRange {
  const WeightTier* tier = weight_tiers();  // absent: the default tier (tiers.h)
  int64_t offset = 0;
  int64_t length = 0;
};

WeightRange weight_range(const OrtApi* api, const OrtKernelInfo* info, int bits,
                         std::vector<int64_t>* shape, const WeightError& bad) {
  WeightRange r;
  std::string tier;
  if (attr_string(api, info, "tier", &tier)) {
    r.tier = find_tier(tier);
    if (r.tier == nullptr) {
      bad(ORT_INVALID_ARGUMENT, "unknown tier '" + tier + "' (" + tier_names() + ")");
    }
  }
  if (!attr_int(api, info, "offset", &r.offset)) bad(ORT_INVALID_ARGUMENT, "attribute 'offset' missing");
  if (!attr_int(api, info, "length", &r.length)) bad(ORT_INVALID_ARGUMENT, "attribute 'length' missing");
  if (!attr_ints(api, info, "shape", shape)) bad(ORT_INVALID_ARGUMENT, "attribute 'shape' missing");

  uint64_t numel = 1;
  for (int64_t d : *shape) {
    if (d < 0) bad(ORT_INVALID_ARGUMENT, "negative dimension in 'shape'");
    numel *= static_cast<uint64_t>(d);
  }
  if (r.offset < 0) bad(ORT_INVALID_ARGUMENT, "negative offset " + std::to_string(r.offset));
  if (r.length < 0) bad(ORT_INVALID_ARGUMENT, "negative length " + std::to_string(r.length));
  const size_t expect = byte_size(numel, bits);
  if (static_cast<uint64_t>(r.length) != expect) {
    bad(ORT_INVALID_ARGUMENT, "length " + std::to_string(r.length) + " does not match shape (" +
                                  std::to_string(expect) + " bytes expected)");
  }
  return r;
}

// The weight's data file, resolved only inside the session's model folder (the node's
// `base_dir`, an absolute path written by the rewriter, is never used) and checked against
// the model's data_size and data_fingerprint and the weight's byte range.
std::shared_ptr<WeightFile> weight_file(const OrtApi* api, const OrtKernelInfo* info,
                                        Registration& reg, const std::string& location,
                                        const WeightRange& r, const WeightError& bad) {
  std::string model_dir;
  try {
    model_dir = reg.model_dir_of(api, info);
  } catch (const Error& e) {
    bad(e.code(), std::string("cannot read the session config: ") + e.what());
  }
  if (model_dir.empty()) {
    bad(ORT_INVALID_ARGUMENT,
        std::string("the model has offloaded weights but no model directory is known: set the "
                    "session config entry '") +
            kModelDirKey +
            "' to the folder of the model file (ho_onnx.session_options(model_path) "
            "does; a model given as bytes needs it set explicitly)" +
            (reg.kernel_config.ok()
                 ? std::string()
                 : std::string("; this onnxruntime (< 1.24) reads it when the library is "
                               "registered: set it before register_custom_ops_library")));
  }
  std::shared_ptr<WeightFile> file;
  try {
    file = resolve_weight_file(model_dir, location);
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
    const std::string fp = reg.fingerprint(*file);
    if (fp != want_fp) {
      bad(ORT_INVALID_ARGUMENT, "'" + file->path() + "' has fingerprint " + fp +
                                    " but the model was optimized for " + want_fp +
                                    " (not the data file this model was written with)");
    }
  }
  if (static_cast<uint64_t>(r.offset) > file_size ||
      static_cast<uint64_t>(r.length) > file_size - static_cast<uint64_t>(r.offset)) {
    bad(ORT_INVALID_ARGUMENT, "offset " + std::to_string(r.offset) + " + length " +
                                  std::to_string(r.length) + " is past the end of '" +
                                  file->path() + "' (" + std::to_string(file_size) + " bytes)");
  }
  return file;
}

}  // namespace

// ---- session creation ---------------------------------------------------------------------

namespace {
// Adds the nanoseconds from construction to destruction to `total`.
class ScopedNs {
 public:
  explicit ScopedNs(std::atomic<uint64_t>* total)
      : total_(total), t0_(std::chrono::steady_clock::now()) {}
  ~ScopedNs() {
    *total_ += static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                         std::chrono::steady_clock::now() - t0_).count());
  }
  ScopedNs(const ScopedNs&) = delete;
  ScopedNs& operator=(const ScopedNs&) = delete;

 private:
  std::atomic<uint64_t>* total_;
  std::chrono::steady_clock::time_point t0_;
};
}  // namespace

std::unique_ptr<Kernel> Kernel::create(const OpDef& op, const OrtApi* api,
                                       const OrtKernelInfo* info, const std::string& node) {
  const ScopedNs timed(&counters().kernel_create_ns);
  auto k = std::make_unique<Kernel>();
  k->api = api;
  k->kind = op.kind;
  k->bits = op.bits;
  k->type = op.type;
  k->gpu = op.cuda;
  k->token_key = op.cuda ? token_address : read_token;
  k->node = node;
  k->engine = op.reg->acquire_engine(op.cuda);
  if (k->gpu) {
    k->device = kernel_device(api, info);
    cuda_set_device(k->device);
  }
  if (op.kind == OpKind::kWait || op.kind == OpKind::kFence) k->init_arena_sampling(op, info);
  if (op.kind == OpKind::kPrefetch || op.kind == OpKind::kWait) {
    int64_t gated = 0;
    k->gated = attr_int(api, info, "gated", &gated) && gated == 1;
  }
  int64_t iteration = 0;
  k->per_iteration = attr_int(api, info, kIterationAttr, &iteration) && iteration == 1;
  if (op.kind == OpKind::kGuard) k->init_guard(info);
  if (op.kind == OpKind::kStore) {
    k->token_dims = {static_cast<int64_t>((128 + k->bits - 1) / k->bits)};
  }
  std::string location;
  if ((op.kind == OpKind::kPrefetch || op.kind == OpKind::kGatherRows ||
       op.kind == OpKind::kHostMatMul) &&
      attr_string(api, info, "location", &location)) {
    k->weight = true;
    k->init_weight(op, info, location);
    if (op.kind == OpKind::kPrefetch) {
      k->init_route(info);
      k->init_warm(info);
    }
  }
  if (op.kind == OpKind::kGatherRows && ((!k->blob && !k->streamed) || k->shape.empty() ||
                                         k->shape[0] <= 0 || k->bits < 8)) {
    fail(ORT_INVALID_ARGUMENT, "GatherRows needs a table of at least one row of whole bytes "
                               "(attributes location/offset/length/shape; tier host or disk; "
                               "no sub-byte element type)");
  }
  if (op.kind == OpKind::kGatherRows) {  // (the table's length was checked against shape)
    const size_t bytes = k->blob ? k->blob->size() : k->streamed->size();
    k->row_bytes = bytes / static_cast<size_t>(k->shape[0]);
  }
  if (op.kind == OpKind::kHostMatMul) k->init_host_matmul(info);
  if (k->gpu) {
    if (op.kind == OpKind::kStore) {
      int64_t host_bytes = op.reg->host_bytes;
      if (host_bytes < 0) attr_int(api, info, kHostBytesAttr, &host_bytes);
      if (host_bytes > 0) k->engine->plan_host_bytes(static_cast<size_t>(host_bytes));
    }
    k->engine->prepare_device(k->device);  // streams, events, staging: not on a run
  }
  return k;
}

// Only with ho_onnx.sample_arena=1 and a runtime that reports statistics.
void Kernel::init_arena_sampling(const OpDef& op, const OrtKernelInfo* info) {
  if (!op.reg->sample_arena || !op.reg->stats.ok()) return;
  OrtStatus* st = api->KernelInfoGetAllocator(info, OrtMemTypeDefault, &alloc);
  if (st != nullptr) {  // no statistics then; never a reason to fail the session
    api->ReleaseStatus(st);
    alloc = nullptr;
  } else {
    stats = &op.reg->stats;
  }
}

void Kernel::init_weight(const OpDef& op, const OrtKernelInfo* info,
                         const std::string& location) {
  const std::string name = weight_name(api, info, node);
  const WeightError bad{"ho_onnx Prefetch of weight '" + name + "' (location '" + location + "')"};
  const WeightRange r = weight_range(api, info, op.bits, &shape, bad);
  std::shared_ptr<WeightFile> file = weight_file(api, info, *op.reg, location, r, bad);
  try {
    std::shared_ptr<const WeightSource> src = r.tier->open(file, r.offset, r.length, name);
    if (r.tier->in_host_memory) {
      const ScopedNs timed(&counters().weight_load_ns);
      blob = engine->load_weight(*src, op.reg->content_key(*file));
    } else {
      engine->prepare_streamed();
      init_expert_cache(info, *src, op.reg->content_key(*file));
      streamed = std::move(src);
      if (cache_group != 0) {
        engine->join_cache_group(cache_group, expert_cache, cache_order, streamed, cache_key);
      }
    }
  } catch (const Error& e) {
    bad(e.code(), e.what());
  }
}

// Attributes `route` and `route_k` of a routed weight Prefetch, checked against its weight
// at session creation.
void Kernel::init_route(const OrtKernelInfo* info) {
  std::string mode;
  if (!attr_string(api, info, "route", &mode)) return;
  const std::string who = "ho_onnx Prefetch '" + node + "': ";
  route = route_mode(mode.c_str());
  if (route == RouteMode::kNone) {
    fail(ORT_INVALID_ARGUMENT, who + "unknown route '" + mode + "' (softmax, topk)");
  }
  if (!gated || !attr_int(api, info, "route_k", &route_k) || route_k < 1) {
    fail(ORT_INVALID_ARGUMENT, who + "a routed Prefetch needs attribute gated = 1 (its "
                                     "router as input 1) and route_k >= 1");
  }
  const size_t bytes = blob ? blob->size() : streamed->size();
  if (shape.empty() || shape[0] < 1 || bytes % static_cast<size_t>(shape[0]) != 0) {
    fail(ORT_INVALID_ARGUMENT, who + "a routed weight is stacked by expert on axis 0 in "
                                     "slices of whole bytes");
  }
}

// The router (input 1) of a routed Prefetch selects the slices that move: those of the
// experts the MoE op will select. Returns false where the whole weight moves instead (the
// CUDA EP: its router is device memory).
bool Kernel::prefetch_routed(OrtKernelContext* ctx, const ExecContext& ec) {
  const size_t bytes = blob ? blob->size() : streamed ? streamed->size() : 0;
  if (route == RouteMode::kNone || gpu || bytes == 0) return false;
  const OrtValue* r = input(api, ctx, 1);
  const TensorInfo ti = tensor_info(api, r);
  if (ti.dims.size() != 2 || ti.dims[1] != shape[0]) {
    std::string dims;
    for (int64_t d : ti.dims) dims += (dims.empty() ? "" : ", ") + std::to_string(d);
    fail(ORT_INVALID_ARGUMENT, "ho_onnx Prefetch '" + node + "': the router input has shape [" +
                                   dims + "] but the weight stacks " + std::to_string(shape[0]) +
                                   " experts (a routed transfer reads [tokens, experts])");
  }
  RouterView v;
  v.data = tensor_data(api, r);
  v.type = ti.type;
  v.rows = static_cast<size_t>(ti.dims[0]);
  v.experts = static_cast<size_t>(ti.dims[1]);
  std::vector<uint32_t> slices = routed_experts(v, route, route_k);
  const size_t slice = bytes / v.experts;
  void* dst = tensor_data(api, output(api, ctx, shape));
  counters().bytes_gated += (v.experts - slices.size()) * slice;
  if (streamed) {
    engine->prefetch_streamed_slices(streamed, slice, std::move(slices), dst, ec);
  } else {
    engine->prefetch_weight_slices(blob, slice, std::move(slices), dst, ec);
  }
  produce_issued(api, ctx);
  return true;
}

// Attributes `warm` (1) and `expert` (>= 0) of a speculative Prefetch, checked against its
// weight at session creation: a gated Prefetch of a streamed tier with an expert cache.
void Kernel::init_warm(const OrtKernelInfo* info) {
  int64_t w = 0;
  if (!attr_int(api, info, kWarmAttr, &w) || w == 0) return;
  const std::string who = "ho_onnx Prefetch '" + node + "': ";
  if (w != 1 || !gated || route != RouteMode::kNone || !streamed ||
      !attr_int(api, info, kExpertAttr, &warm_expert) || warm_expert < 0) {
    fail(ORT_INVALID_ARGUMENT, who + "a warm Prefetch needs warm = 1, gated = 1 (the "
                                     "predicted expert indices as input 1), expert >= 0, no "
                                     "route, and a streamed tier (disk)");
  }
  int64_t cache = 0;
  if (!attr_int(api, info, kExpertCacheAttr, &cache) || cache <= 0) {
    fail(ORT_INVALID_ARGUMENT, who + "a warm Prefetch fills the expert cache: it needs "
                                     "expert_cache > 0");
  }
  warm = true;
}

// Attribute `expert_cache` (bytes, on a streamed weight's Prefetch): its loads go through
// the engine's expert cache, which the model asks to hold that many bytes. Ignored on a tier
// in host memory (a cache there would copy host memory to host memory).
void Kernel::init_expert_cache(const OrtKernelInfo* info, const WeightSource& src,
                               const std::string& content) {
  int64_t bytes = 0;
  if (!attr_int(api, info, kExpertCacheAttr, &bytes) || bytes == 0) return;
  if (bytes < 0) {
    fail(ORT_INVALID_ARGUMENT, std::string("negative ") + kExpertCacheAttr + " " +
                                   std::to_string(bytes));
  }
  // A decode cache is one per group, whatever file its weights are in (its keys name the
  // file): the limit its Guards set holds for all of them (a cache per file held the limit
  // once per file: found with a plan whose split weights went to a second file).
  int64_t group = 0;
  attr_int(api, info, kCacheGroupAttr, &group);
  const std::string cache_name =
      group != 0 ? "ho_onnx.decode_cache:" + std::to_string(group) : content;
  expert_cache = engine->expert_cache(cache_name, static_cast<size_t>(bytes));
  if (expert_cache) cache_key = weight_key(src, content);
  if (group != 0 && expert_cache) {
    cache_group = static_cast<uint64_t>(group);
    if (!attr_int(api, info, kCacheOrderAttr, &cache_order) || cache_order < 0) cache_order = -1;
  }
}

// ---- Compute ------------------------------------------------------------------------------

ExecContext Kernel::cpu_context(OrtKernelContext* ctx) const {
  ExecContext ec{};
  ec.kernel = identity;
  ec.api = api;
  ec.kctx = ctx;
  return ec;
}

// GPU EP: no kernel reads device memory on the host (token_key is token_address); the
// engine writes tokens and does the un-aliased output copies on the stream (ec.out).
ExecContext Kernel::gpu_context(OrtKernelContext* ctx) const {
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
  return ec;
}

void Kernel::compute(OrtKernelContext* ctx) {
  if (engine->forked_away()) {  // (a parent's session: waited forever on its threads)
    fail(ORT_FAIL, "this session was created before the process forked; its transfers "
                   "ran on threads (and a CUDA context) of the parent process: create the "
                   "session in the forked process");
  }
  ExecContext ec = gpu ? gpu_context(ctx) : cpu_context(ctx);
  const uint64_t epoch = engine->enter_run(ec.kernel, per_iteration);  // (first: engine.h)
  switch (kind) {
    case OpKind::kPrefetch:
      return weight ? prefetch_weight(ctx, ec) : prefetch_stored(ctx, ec);
    case OpKind::kWait:
      return wait(ctx, ec);
    case OpKind::kStore:
      return store(ctx, ec);
    case OpKind::kDetach:
      return detach(ctx, ec);
    case OpKind::kGuard:
      return guard(ctx, epoch);
    case OpKind::kPrefetchInput:
      return prefetch_input(ctx, ec);
    case OpKind::kEmit:
      return emit(ctx, ec);
    case OpKind::kGatherRows:
      return gather_rows(ctx);
    case OpKind::kHostMatMul:
      return host_matmul(ctx);
    case OpKind::kFence:
      return fence(ctx, ec);
  }
}

// Attributes: axes, lo, hi (ints, one per checked dim), dims (the dims' names, one per line)
// and input (the graph input's name). A model whose attributes disagree fails session
// creation, never a run.
void Kernel::init_guard(const OrtKernelInfo* info) {
  std::vector<int64_t> axes, lo, hi;
  std::string joined;
  if (!attr_ints(api, info, "axes", &axes) || !attr_ints(api, info, "lo", &lo) ||
      !attr_ints(api, info, "hi", &hi) || !attr_string(api, info, "dims", &joined)) {
    fail(ORT_INVALID_ARGUMENT, "attributes 'axes', 'lo', 'hi' and 'dims' are required");
  }
  attr_string(api, info, "input", &input_name);
  std::vector<std::string> dims;
  size_t start = 0;
  for (size_t i = 0; i <= joined.size(); ++i) {
    if (i == joined.size() || joined[i] == '\n') {
      dims.push_back(joined.substr(start, i - start));
      start = i + 1;
    }
  }
  if (axes.size() != lo.size() || axes.size() != hi.size() || axes.size() != dims.size() ||
      axes.empty()) {
    fail(ORT_INVALID_ARGUMENT, "'axes', 'lo', 'hi' and 'dims' must have one entry per dim");
  }
  for (size_t i = 0; i < axes.size(); ++i) {
    if (axes[i] < 0 || lo[i] < 0 || hi[i] < lo[i]) {
      fail(ORT_INVALID_ARGUMENT, "dim '" + dims[i] + "': axis " + std::to_string(axes[i]) +
                                     ", range " + std::to_string(lo[i]) + ".." +
                                     std::to_string(hi[i]) + " is not a range of a dim");
    }
    ranges.push_back(DimRange{axes[i], lo[i], hi[i], dims[i]});
  }
  init_guard_cache(info);
}

// Attributes cache_group, cache_points (a row of this Guard's dims per point), cache_bytes
// and cache_ahead (one per point, at most 64 points; cache_ahead optional, 0), cache_guards
// (the Guards of the group: the last of a run sets the limits; optional, 1): the decode
// cache's limits per run.
void Kernel::init_guard_cache(const OrtKernelInfo* info) {
  int64_t group = 0;
  if (!attr_int(api, info, kCacheGroupAttr, &group) || group == 0) return;
  std::vector<int64_t> points;
  const std::string who = "ho_onnx Guard '" + node + "': ";
  if (!attr_ints(api, info, kCachePointsAttr, &points) ||
      !attr_ints(api, info, kCacheBytesAttr, &cache_bytes) || cache_bytes.empty() ||
      cache_bytes.size() > 64 || points.size() != cache_bytes.size() * ranges.size()) {
    fail(ORT_INVALID_ARGUMENT, who + "a decode cache needs cache_points (one value per dim "
                                     "per point) and cache_bytes (one per point, 1 to 64)");
  }
  if (!attr_int(api, info, kCacheGuardsAttr, &cache_guards) || cache_guards < 1) {
    cache_guards = 1;
  }
  if (!attr_ints(api, info, kCacheAheadAttr, &cache_ahead)) {
    cache_ahead.assign(cache_bytes.size(), 0);
  }
  if (cache_ahead.size() != cache_bytes.size()) {
    fail(ORT_INVALID_ARGUMENT, who + "cache_ahead needs one value per point");
  }
  for (size_t p = 0; p < cache_bytes.size(); ++p) {
    if (cache_bytes[p] < 0 || cache_ahead[p] < 0) {
      fail(ORT_INVALID_ARGUMENT, who + "negative cache_bytes or cache_ahead at point " +
                                     std::to_string(p));
    }
  }
  for (size_t p = 0; p < cache_bytes.size(); ++p) {
    cache_points.emplace_back(points.begin() + static_cast<ptrdiff_t>(p * ranges.size()),
                              points.begin() + static_cast<ptrdiff_t>((p + 1) * ranges.size()));
  }
  cache_group = static_cast<uint64_t>(group);
}

namespace {
// The decode cache's points a run may still use (a bit per point), per group, on this
// thread: each Guard of the run narrows it; a new run (epoch) starts from every point.
struct GuardPhase {
  uint64_t epoch = 0;
  uint64_t points = 0;
  int64_t guards = 0;  // (Guards of the group run so far in the epoch)
};
thread_local std::unordered_map<uint64_t, GuardPhase> t_guard_phases;
}  // namespace

// The bytes the run may keep in the group's caches and read ahead: those of the point with
// the most room among the points that cover the dims of every Guard run so far in this run
// (its first Guard starts from all of them); a run no point covers keeps and reads none.
void Kernel::limit_cache(uint64_t epoch, const TensorInfo& ti) {
  uint64_t mine = 0;
  for (size_t p = 0; p < cache_points.size(); ++p) {
    bool covered = true;
    for (size_t i = 0; i < ranges.size(); ++i) {
      covered = covered && ti.dims[static_cast<size_t>(ranges[i].axis)] <= cache_points[p][i];
    }
    if (covered) mine |= uint64_t{1} << p;
  }
  GuardPhase& phase = t_guard_phases[cache_group];
  if (phase.epoch != epoch) phase = GuardPhase{epoch, ~uint64_t{0}, 0};
  phase.points &= mine;
  // Only the run's last Guard knows every dim: an earlier one's point may split its room
  // otherwise (its limits would drop the reads ahead a later one keeps).
  if (++phase.guards < cache_guards) return;
  int64_t kept = 0, ahead = 0;  // (the covering point with the most room: its split)
  for (size_t p = 0; p < cache_bytes.size(); ++p) {
    if (((phase.points >> p) & 1) && cache_bytes[p] + cache_ahead[p] > kept + ahead) {
      kept = cache_bytes[p];
      ahead = cache_ahead[p];
    }
  }
  engine->limit_cache_group(cache_group, static_cast<size_t>(kept), static_cast<size_t>(ahead));
}

// Reads only its input's shape (never its data: on the CUDA EP it is device memory) and
// produces an empty output, an ordering input of the cache ops.
void Kernel::guard(OrtKernelContext* ctx, uint64_t epoch) {
  const TensorInfo ti = tensor_info(api, input(api, ctx, 0));
  for (const DimRange& r : ranges) {  // (messages built only on failure: this runs per run)
    if (static_cast<size_t>(r.axis) >= ti.dims.size()) {
      fail(ORT_INVALID_ARGUMENT, "input '" + input_name + "' has " + std::to_string(ti.dims.size()) +
                                     " dims: no axis " + std::to_string(r.axis) + " (dim '" +
                                     r.name + "')");
    }
    const int64_t d = ti.dims[static_cast<size_t>(r.axis)];
    if (d < r.lo || d > r.hi) {
      fail(ORT_INVALID_ARGUMENT,
           "input '" + input_name + "' dim '" + r.name + "' is " + std::to_string(d) + ", outside the range " +
               std::to_string(r.lo) + ".." + std::to_string(r.hi) +
               " this model was planned for (its memory plan does not hold there): "
               "optimize it again with --dim " + r.name + "=LO..HI covering " +
               std::to_string(d));
    }
  }
  if (cache_group != 0) limit_cache(epoch, ti);
  output(api, ctx, {0});
}

// Fence: its output is its input, after its ordering inputs (ORT aliases the two: nothing is
// copied); an opaque value to ORT's optimizers, so nodes computed again from it (a
// recomputed activation: schedule/recompute.py) are never merged with the first ones.
void Kernel::fence(OrtKernelContext* ctx, ExecContext& ec) {
  const OrtValue* x = input(api, ctx, 0);
  const TensorInfo ti = tensor_info(api, x);
  const size_t bytes = byte_size(ti.numel, bits);
  OrtValue* y = output(api, ctx, ti.dims);
  if (stats != nullptr) sample_arena(*stats, api, alloc, node);
  if (bytes == 0) return;
  const void* src = tensor_data(api, x);
  void* dst = tensor_data(api, y);
  if (dst == src) return;
  counters().alias_copies += 1;  // (ORT did not alias them)
#if HO_ONNX_WITH_CUDA
  if (gpu) return cuda_copy_device(dst, src, bytes, ec.stream);
#endif
  (void)ec;
  std::memcpy(dst, src, bytes);
}

// The gate (input 1) of a gated Prefetch or Wait is empty: no token reaches the reader.
bool Kernel::gate_closed(OrtKernelContext* ctx) const {
  if (!gated) return false;
  size_t n = 0;
  check(api, api->KernelContext_GetInputCount(ctx, &n));
  if (n < 2) fail(ORT_INVALID_ARGUMENT, "attribute 'gated' needs a gate as input 1");
  return tensor_info(api, input(api, ctx, 1)).numel == 0;
}

// A warm Prefetch: its output is empty; the read into the cache starts when the predicted
// indices (input 1, int64, any shape) hold its expert.
void Kernel::warm_weight(OrtKernelContext* ctx) {
  output(api, ctx, {0});
  produce_issued(api, ctx);
  if (gpu || !expert_cache) return;  // (the CUDA engine has no expert cache to warm)
  size_t n = 0;
  check(api, api->KernelContext_GetInputCount(ctx, &n));
  if (n < 2) fail(ORT_INVALID_ARGUMENT, "attribute 'warm' needs the predicted experts as input 1");
  const OrtValue* g = input(api, ctx, 1);
  const TensorInfo ti = tensor_info(api, g);
  if (ti.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64) {
    fail(ORT_INVALID_ARGUMENT, "ho_onnx Prefetch '" + node + "': a warm Prefetch reads int64 "
                                   "expert indices as input 1");
  }
  const auto* idx = static_cast<const int64_t*>(ti.numel ? tensor_data(api, g) : nullptr);
  for (size_t i = 0; i < ti.numel; ++i) {
    if (idx[i] == warm_expert) {
      engine->warm_cached(streamed, expert_cache, cache_key);
      return;
    }
  }
}

void Kernel::prefetch_weight(OrtKernelContext* ctx, const ExecContext& ec) {
  if (warm) return warm_weight(ctx);
  if (gate_closed(ctx)) {  // an expert no token was routed to: nothing moves
    output(api, ctx, shape);
    counters().gated_skips += 1;
    counters().bytes_gated += streamed ? streamed->size() : blob->size();
    produce_issued(api, ctx);
    return;
  }
  if (prefetch_routed(ctx, ec)) return;
  OrtValue* y = output(api, ctx, shape);
  if (streamed && expert_cache) {
    engine->prefetch_cached(streamed, expert_cache, cache_key,
                            streamed->size() ? tensor_data(api, y) : nullptr, ec,
                            cache_group, cache_order);
  } else if (streamed) {
    engine->prefetch_streamed(streamed, streamed->size() ? tensor_data(api, y) : nullptr, ec);
  } else {
    engine->prefetch_weight(blob, blob->size() ? tensor_data(api, y) : nullptr, ec);
  }
  produce_issued(api, ctx);
}

void Kernel::prefetch_stored(OrtKernelContext* ctx, const ExecContext& ec) {
  const StoreKey key = token_key(api, input(api, ctx, 0), bits);
  std::shared_ptr<StoredTensor> rec = engine->take_stored(key, ec);
  check_stored(*rec, type, bits);
  OrtValue* y = output(api, ctx, rec->shape());
  void* dst = rec->bytes() ? tensor_data(api, y) : nullptr;
  engine->prefetch_stored(std::move(rec), dst, ec);
  produce_issued(api, ctx);
}

// The source is a graph input in host memory (on the CUDA EP declared CPU memory: ORT hands
// over the caller's buffer). `y` gets its shape; the Wait completes the copy.
void Kernel::prefetch_input(OrtKernelContext* ctx, const ExecContext& ec) {
  const OrtValue* src = input(api, ctx, 0);
  const TensorInfo ti = tensor_info(api, src);
  const size_t bytes = byte_size(ti.numel, bits);
  OrtValue* y = output(api, ctx, ti.dims);
  engine->prefetch_input(bytes ? tensor_data(api, src) : nullptr, bytes,
                         bytes ? tensor_data(api, y) : nullptr, ec);
  produce_issued(api, ctx);
}

// CPU EP only (registration.cc): on a CUDA session ORT copies the input to host memory
// before this node, which is the point (the device buffer is freed there).
// Its optional second output ("done", empty, like a Prefetch's "issued") is an ordering
// input of the next cache op, so that ORT's DEFAULT order, which runs a node nobody reads
// after the rest of the graph, runs the Emit there and frees the present at its last reader.
void Kernel::emit(OrtKernelContext* ctx, const ExecContext& ec) {
  const OrtValue* x = input(api, ctx, 0);
  const TensorInfo ti = tensor_info(api, x);
  const size_t bytes = byte_size(ti.numel, bits);
  OrtValue* y = output(api, ctx, ti.dims);
  produce_issued(api, ctx);
  if (bytes == 0) return;
  void* dst = tensor_data(api, y);
  const void* src = tensor_data(api, x);
  // A present KV output: the whole cache of a layer at every step (a 32k context's 67 MB in
  // the bench of stop 48), so over ORT's threads.
  if (dst != src) copy_in_compute(ec, dst, src, bytes);
  counters().bytes_emitted += bytes;
}

// Like Gather(table, ids) on axis 0: the output is ids.shape + the table's row shape; a
// negative id counts from the end; an id outside [-rows, rows) fails the run. A table of a
// streamed tier (disk) is read a row at a time from its file, here, inside this Compute,
// straight into the output (no staging: nothing is in flight after it returns).
void Kernel::gather_rows(OrtKernelContext* ctx) {
  const OrtValue* ids = input(api, ctx, 1);
  const TensorInfo ti = tensor_info(api, ids);
  std::vector<int64_t> dims = ti.dims;
  dims.insert(dims.end(), shape.begin() + 1, shape.end());
  const size_t row = row_bytes;
  OrtValue* y = output(api, ctx, dims);
  if (ti.numel == 0 || row == 0) return;
  const auto* id = static_cast<const int64_t*>(tensor_data(api, ids));
  auto* dst = static_cast<char*>(tensor_data(api, y));
  const char* table = blob ? static_cast<const char*>(blob->data()) : nullptr;
  const int64_t rows = shape[0];
  for (size_t i = 0; i < ti.numel; ++i) {
    const int64_t r = id[i] < 0 ? id[i] + rows : id[i];
    if (r < 0 || r >= rows) {
      fail(ORT_INVALID_ARGUMENT, "index " + std::to_string(id[i]) + " is out of range [-" +
                                     std::to_string(rows) + ", " + std::to_string(rows) + ")");
    }
    if (table != nullptr) {
      std::memcpy(dst + i * row, table + static_cast<size_t>(r) * row, row);
    } else {
      try {
        streamed->read(streamed->offset() + static_cast<uint64_t>(r) * row, row, dst + i * row);
      } catch (const std::exception& e) {
        fail(ORT_FAIL, std::string("GatherRows: ") + e.what());
      }
    }
  }
  counters().bytes_gathered += ti.numel * row;
}

// The weight [K, N] (K, N > 0) in the host store; ORT's MatMul of opset 13 for the node's
// element type, found in the CPU EP's kernel registry (a type it has no MatMul for fails
// here, at session creation).
void Kernel::init_host_matmul(const OrtKernelInfo* info) {
  if (!blob || shape.size() != 2 || shape[0] <= 0 || shape[1] < 0 || bits < 8) {
    fail(ORT_INVALID_ARGUMENT, "HostMatMul needs a host-tier 2-D weight [K, N] with K > 0 "
                               "of whole-byte elements (attributes location/offset/length/"
                               "shape; tier host)");
  }
  OrtMemoryInfo* mem = nullptr;
  check(api, api->CreateCpuMemoryInfo(OrtDeviceAllocator, OrtMemTypeDefault, &mem));
  std::unique_ptr<OrtMemoryInfo, void (*)(OrtMemoryInfo*)> hold(mem, api->ReleaseMemoryInfo);
  // (read only: ORT's MatMul never writes its inputs)
  check(api, api->CreateTensorWithDataAsOrtValue(
                 mem, const_cast<void*>(blob->data()), blob->size(), shape.data(),
                 shape.size(), type, &weight_value));
  const char* names[] = {"T"};
  const ONNXTensorElementDataType types[] = {type};
  OrtStatus* st = api->CreateOp(info, "MatMul", "", 13, names, types, 1, nullptr, 0, 2, 1,
                                &matmul);
  if (st != nullptr) {
    const std::string why = api->GetErrorMessage(st);
    api->ReleaseStatus(st);
    fail(ORT_INVALID_ARGUMENT, "ORT's CPU execution provider has no MatMul for element type " +
                                   std::to_string(static_cast<int>(type)) + ": " + why);
  }
}

// y = MatMul(x, W): x [..., K] (input 1), y [..., N], computed by ORT's own MatMul kernel on
// the weight's bytes in the host store. An empty x (no token routed to the expert) does no
// work; an x whose last dim is not K fails the run before anything is read.
void Kernel::host_matmul(OrtKernelContext* ctx) {
  const OrtValue* x = input(api, ctx, 1);
  const TensorInfo ti = tensor_info(api, x);
  if (ti.dims.empty() || ti.dims.back() != shape[0]) {
    fail(ORT_INVALID_ARGUMENT,
         "input x has shape of rank " + std::to_string(ti.dims.size()) + " and last dim " +
             (ti.dims.empty() ? std::string("none") : std::to_string(ti.dims.back())) +
             " but the weight is [" + std::to_string(shape[0]) + ", " +
             std::to_string(shape[1]) + "]: MatMul needs x's last dim to be " +
             std::to_string(shape[0]));
  }
  std::vector<int64_t> dims = ti.dims;
  dims.back() = shape[1];
  OrtValue* y = output(api, ctx, dims);
  if (ti.numel == 0 || shape[1] == 0) return;  // no token routed here: nothing to compute
  const OrtValue* ins[] = {x, weight_value};
  OrtValue* outs[] = {y};
  check(api, api->InvokeOp(ctx, matmul, ins, 2, outs, 1));
  counters().host_matmuls += 1;
  counters().host_matmul_rows += ti.numel / static_cast<size_t>(shape[0]);
}

void Kernel::wait(OrtKernelContext* ctx, ExecContext& ec) {
  const OrtValue* y = input(api, ctx, 0);
  const TensorInfo ti = tensor_info(api, y);
  const size_t bytes = byte_size(ti.numel, bits);
  OrtValue* z = output(api, ctx, ti.dims);
  if (bytes == 0 || gate_closed(ctx)) return;  // (closed: its Prefetch started nothing)
  const void* src = tensor_data(api, y);
  void* dst = tensor_data(api, z);
  // The engine copies from its own memory into z (= y when ORT aliased them). GPU EP: on the
  // compute stream, into ec.out, and it counts the un-aliased copies itself.
  if (gpu) ec.out = dst;
  engine->wait(src, dst, bytes, ec);
  if (!gpu && dst != src) counters().alias_copies += 1;
  if (stats != nullptr) sample_arena(*stats, api, alloc, node);
}

void Kernel::store(OrtKernelContext* ctx, ExecContext& ec) {
  const OrtValue* x = input(api, ctx, 0);
  const TensorInfo ti = tensor_info(api, x);
  const size_t bytes = byte_size(ti.numel, bits);
  void* token = tensor_data(api, output(api, ctx, token_dims));
  if (gpu) ec.out = token;  // GPU EP: the engine writes the device token on the stream
  const StoreKey key =
      engine->store(bytes ? tensor_data(api, x) : nullptr, bytes, ti.dims, type, ec);
  if (!gpu) write_token(token, key);
}

void Kernel::detach(OrtKernelContext* ctx, ExecContext& ec) {
  const OrtValue* tok = input(api, ctx, 1);
  const StoreKey key = token_key(api, tok, bits);
  const TensorInfo ti = tensor_info(api, tok);
  void* dst = tensor_data(api, output(api, ctx, ti.dims));
  // GPU EP: the engine copies token -> token2 on the stream when ORT did not alias them.
  if (gpu) ec.out = dst;
  engine->detach(key, ec);
  const void* src = tensor_data(api, tok);
  if (!gpu && dst != src) {
    std::memcpy(dst, src, kTokenBytes);
    counters().alias_copies += 1;
  }
}

}  // namespace ho
