// The engine seam: everything a kernel asks of the transfer machinery.
//
// An Engine is created per RegisterCustomOps call (a "registration") by the first kernel
// that needs one, shared by that registration's kernels through std::shared_ptr, and
// destroyed (worker threads joined, memory freed) with the last of them.
//
// The CPU engine (cpu_engine.cc) copies into and out of ORT's buffers only inside the ops'
// Compute calls (the transfer lifetime rule, docs/design.md) and reads streamed weights
// (the disk tier: tiers.h) on a channel of I/O threads into its own staging buffers. The CUDA engine
// (csrc/cuda/cuda_engine.cc, docs/cuda.md) implements the same interface: `ExecContext::stream`
// carries the kernel's compute stream and the copies are cudaMemcpyAsync on copy streams,
// ordered with the compute stream by events. On the GPU EP a Store token lives in device
// memory, so the GPU kernels name a store by the token's device address (passed as the
// `id` of detach/take_stored), never by reading the token.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <onnxruntime_c_api.h>

#include "common.h"

namespace ho {

class WeightSource;
class ExpertCacheBase;

// Per-call context a kernel passes to the engine.
struct ExecContext {
  void* stream = nullptr;  // the kernel's compute stream (GPU EP), else null
  int device = 0;          // the kernel's device (GPU EP)
  // GPU EP: the op's output where the engine writes it itself: the token of a Store, the
  // token2 of a Detach, the z of a Wait (the engine copies on the compute stream when ORT
  // did not alias it). Null on the CPU EP (kernel.cc copies there).
  void* out = nullptr;
  // The calling kernel's identity, unique in the process and never reused (not its address:
  // a later session's kernel may get a freed kernel's address): tells runs apart (an
  // engine's run tracking, see "Transfer lifetime rule" in docs/design.md).
  const void* kernel = nullptr;
  // CPU EP: the kernel's context, so that large copies can use ORT's intra-op threads
  // (KernelContext_ParallelFor) inside the Compute call. Null: copy on this thread.
  const OrtApi* api = nullptr;
  OrtKernelContext* kctx = nullptr;
};

// A copy inside a Compute call: from 2 MiB on split over ORT's intra-op threads
// (KernelContext_ParallelFor, idle while the kernel runs under the sequential executor), else
// one memcpy (also where ctx has no kernel context; HO_ONNX_PARALLEL_COPY=0 turns it off).
void copy_in_compute(const ExecContext& ctx, void* dst, const void* src, size_t n);

// What a Store writes into its token: the store's id and a random tag that the reload and
// the Detach must present (ids are guessable, tags are not).
struct StoreKey {
  uint64_t id = 0;
  uint64_t tag = 0;
};

// Bytes of one weight of a tier in host memory (tiers.h), read once into the host store.
class HostBlob {
 public:
  virtual ~HostBlob() = default;
  virtual const void* data() const = 0;
  virtual size_t size() const = 0;
};

// An activation held in the slow tier, taken out of the engine by the Prefetch that
// reloads it (one reload per store).
class StoredTensor {
 public:
  virtual ~StoredTensor() = default;
  virtual const std::vector<int64_t>& shape() const = 0;
  virtual size_t bytes() const = 0;
  virtual ONNXTensorElementDataType elem_type() const = 0;
};

class Engine {
 public:
  virtual ~Engine() = default;

  // fork_generation() when it was made: an engine of an earlier generation, in a forked
  // child, is the parent's (its transfer threads and CUDA context stayed there): its kernels
  // refuse to run, it is never destroyed (abandon_engine) and new sessions get a new one.
  const uint64_t generation = fork_generation();
  bool forked_away() const { return generation != fork_generation(); }

  // The two movements of a weight (tiers.h: a tier's entry says which one it takes; the
  // engines never see the tier itself).

  // A tier in host memory: the bytes of `src` read into the host store at most once per
  // engine while a caller holds them, shared by every caller asking for the same range of
  // the same content (`content`: Registration::content_key of the data file).
  virtual std::shared_ptr<const HostBlob> load_weight(const WeightSource& src,
                                                      const std::string& content) = 0;

  // Start copying `blob` into `dst` (fast tier) on the load channel; keyed by `dst`.
  virtual void prefetch_weight(const std::shared_ptr<const HostBlob>& blob, void* dst,
                               const ExecContext& ctx) = 0;

  // A routed transfer (routing.h) of a host-tier weight stacked by expert on axis 0: only
  // the slices `slices` (each `slice_bytes` bytes at slice * slice_bytes) are copied into
  // `dst`; the rest of `dst` is left as ORT gave it (its reader reads none of it). Keyed by
  // `dst` like every load. An engine without it moves the whole weight.
  virtual void prefetch_weight_slices(const std::shared_ptr<const HostBlob>& blob,
                                      size_t slice_bytes, std::vector<uint32_t> slices,
                                      void* dst, const ExecContext& ctx) {
    (void)slice_bytes;
    (void)slices;
    prefetch_weight(blob, dst, ctx);
  }

  // The same for a streamed tier (prefetch_streamed): only the selected slices are read.
  virtual void prefetch_streamed_slices(const std::shared_ptr<const WeightSource>& src,
                                        size_t slice_bytes, std::vector<uint32_t> slices,
                                        void* dst, const ExecContext& ctx) {
    (void)slice_bytes;
    (void)slices;
    prefetch_streamed(src, dst, ctx);
  }

  // A streamed tier, at session creation: set up the I/O channel (and its staging) that
  // prefetch_streamed reads on, so that runs allocate nothing.
  virtual void prepare_streamed() = 0;

  // Start reading `src` (WeightSource::read, in chunks) into `dst` (fast tier) on the I/O
  // channel (background I/O threads, FIFO); keyed by `dst` like every load. A read error
  // (e.g. the file was truncated after the session was created) is reported by the
  // matching wait().
  virtual void prefetch_streamed(const std::shared_ptr<const WeightSource>& src, void* dst,
                                 const ExecContext& ctx) = 0;

  // Session creation: a model asks for an expert cache of `bytes` bytes for the streamed
  // weights of the data file `content` (Registration::content_key; the attribute
  // `expert_cache` of its cached Prefetches). The CPU engine returns that file's cache
  // (expert_cache.h; made, or raised to `bytes`), which the kernel holds; an engine without
  // one returns null (the CUDA engine: no device-memory cache yet).
  virtual std::shared_ptr<ExpertCacheBase> expert_cache(const std::string& /*content*/,
                                                        size_t /*bytes*/) {
    return nullptr;
  }

  // Like prefetch_streamed, through `cache` (from expert_cache(), not null) under `key`
  // (weight_key of `src`): a hit copies the cached bytes (nothing is read), a miss reads them
  // into a buffer the cache then keeps.
  // A decode-cache Prefetch (`group` not 0, docs/design.md "The decode cache") keeps a miss
  // only if it fits without evicting anything, takes its bytes from the group's read-ahead
  // when an earlier Prefetch read them there (`order`: its place in the group, -1: none),
  // and then reads the group's next weights ahead within the run's read-ahead limit.
  virtual void prefetch_cached(const std::shared_ptr<const WeightSource>& src,
                               const std::shared_ptr<ExpertCacheBase>& /*cache*/,
                               const std::string& /*key*/, void* dst, const ExecContext& ctx,
                               uint64_t /*group*/ = 0, int64_t /*order*/ = -1) {
    prefetch_streamed(src, dst, ctx);
  }

  // The decode cache: session creation puts each of its Prefetches in the plan's group
  // `group` (attributes `cache_group`, `cache_order`: its place in the group's reads, -1
  // none) with its cache (from expert_cache()), weight and key; a run's Guards then limit
  // the group's caches to `kept` bytes and its read-ahead to `ahead` bytes, from that run's
  // dims (evicting down to them at once). An engine without caches ignores both.
  virtual void join_cache_group(uint64_t /*group*/,
                                const std::shared_ptr<ExpertCacheBase>& /*cache*/,
                                int64_t /*order*/,
                                const std::shared_ptr<const WeightSource>& /*src*/,
                                const std::string& /*key*/) {}
  virtual void limit_cache_group(uint64_t /*group*/, size_t /*kept*/, size_t /*ahead*/) {}

  // Speculation: start reading `src` into `cache` (from expert_cache(), not null) under `key`
  // unless the cache holds it; nothing waits for the read (a later prefetch_cached of the
  // key finds the entry and waits for it there). The read fills library memory only.
  virtual void warm_cached(const std::shared_ptr<const WeightSource>& /*src*/,
                           const std::shared_ptr<ExpertCacheBase>& /*cache*/,
                           const std::string& /*key*/) {}

  // Start copying the `bytes` bytes at `src`, a tensor the run holds in host memory (a graph
  // input the caller passed: its past KV cache), into `dst` (fast tier) on the load channel;
  // keyed by `dst`. `src` is the caller's and lives for the run: the CPU engine reads it only
  // in the matching wait(); the CUDA engine copies from it on the load stream (a pageable
  // source is staged by the driver before cudaMemcpyAsync returns; a pinned one is read by
  // the copy, which a failed run may leave in flight: it lands in staging nobody reads).
  virtual void prefetch_input(const void* src, size_t bytes, void* dst,
                              const ExecContext& ctx) = 0;

  // Copy `bytes` at `src` (element type `type`, shape `shape`) into the host pool; returns
  // the key written into the token. The CPU engine copies before returning (`src` is ORT's).
  virtual StoreKey store(const void* src, size_t bytes, std::vector<int64_t> shape,
                         ONNXTensorElementDataType type, const ExecContext& ctx) = 0;

  // Block until the store `key` finished reading its source.
  virtual void detach(const StoreKey& key, const ExecContext& ctx) = 0;

  // Remove the stored tensor `key` from the engine (the caller reloads it). Refused when the
  // key is unknown, its tag is wrong, or it belongs to an earlier run.
  virtual std::shared_ptr<StoredTensor> take_stored(const StoreKey& key,
                                                    const ExecContext& ctx) = 0;

  // Start copying a taken stored tensor into `dst` on the load channel (after its store
  // completed); its host memory returns to the pool when the copy is done. Keyed by `dst`.
  virtual void prefetch_stored(std::shared_ptr<StoredTensor> stored, void* dst,
                               const ExecContext& ctx) = 0;

  // Complete the transfer registered for the Prefetch output `dst` (of `bytes` bytes) into
  // the Wait's output `out` (which may be `dst`). CPU engine: copies into `out` before it
  // returns. GPU EP: "complete" means make the compute stream wait for it (the host returns
  // at once) and copy on the stream into ctx.out.
  virtual void wait(const void* dst, void* out, size_t bytes, const ExecContext& ctx) = 0;

  // Session creation, once per kernel of a GPU EP: set up `device` (streams, event pool,
  // disk staging) so that runs allocate nothing. No-op on the CPU engine.
  virtual void prepare_device(int /*device*/) {}

  // The kernel `kernel` (an ExecContext::kernel) is destroyed with its session: release
  // what its runs left (a failed run's stores and loads) and forget it. Never throws.
  virtual void forget_kernel(const void* kernel) noexcept = 0;
  // Every cache op's Compute enters its thread's run first, whatever it then does (so the
  // engines' record calls pass no kernel, only ctx.kernel as the records' creator): a
  // kernel that executes again on a thread starts a new run there (run_records.h). One that
  // skipped it on an empty tensor (a past KV cache of length 0 at a prompt's first run)
  // left the next run in the old one until a kernel seen there ran, and that kernel's
  // entry released the loads this run had already made (stop 49). `per_iteration`: the op
  // is in a Loop/Scan body (attribute `iteration` = 1): seen again, it starts the body's
  // next iteration instead (RunRecords::enter).
  // Returns the run's epoch on this thread (run_records.h: a new number for every run).
  virtual uint64_t enter_run(const void* kernel, bool per_iteration) = 0;

  // Session creation: the plan stores `bytes` bytes of activations per run (a Store's
  // `host_bytes` attribute or the session config entry ho_onnx.host_bytes), so the engine
  // can size its host memory for a run up front. No-op on the CPU engine.
  virtual void plan_host_bytes(size_t /*bytes*/) {}
};

// Limits of a registration's engines (session config entries).
struct EngineLimits {
  // Bytes of stored activations the host pool may hold (in use + cached free buffers);
  // ho_onnx.host_pool_limit_bytes, default: half the machine's physical memory.
  uint64_t host_pool_limit = 0;
};

std::shared_ptr<Engine> make_cpu_engine(const EngineLimits& limits);

}  // namespace ho
