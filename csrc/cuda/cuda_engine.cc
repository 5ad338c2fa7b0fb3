// CUDA-EP engine: the four cache ops on ORT's compute stream, with copies on one
// host-to-device and one device-to-host stream per device, ordered by pooled events.
//
// Transfer lifetime rule (docs/design.md): a copy on another stream may outlive the run
// (a failed run never reaches its Wait or Detach, and ORT's CUDA allocator hands the freed
// block to the next allocation at once, trusting that every kernel runs on the one compute
// stream). So no copy on a copy stream ever WRITES memory of ORT: loads land in the
// engine's device staging (DeviceStaging) and the Wait copies staging -> z on the compute
// stream, in the op's stream order. The hazards, each enforced in exactly one place,
// marked HAZARD (a), (b), (c) below:
//
//  (a) A load must not overwrite a staging buffer before the last copy that used it (the
//      Wait's device-to-device copy out of it, on some compute stream, or a failed run's
//      load into it) is done: the buffer's fence event, waited for by the load stream
//      (begin_load). It no longer writes the Prefetch's output, so it needs no edge from
//      the compute stream.
//  (b) A stored tensor's block goes back to ORT right after its Detach. The device-to-host
//      copy must have finished reading it by then: Detach makes the compute stream wait on
//      the store's completion event (detach), so any later kernel that reuses the block runs
//      after the copy. In a failed run (no Detach) the copy may READ a block ORT reused:
//      allowed by the rule's argument (the arena keeps blocks mapped, cudaFree synchronizes
//      the device first, and the record of a failed run is never reloaded).
//  (c) A Wait's consumers read its output: Wait makes the compute stream wait on the load's
//      completion event, then copies staging -> z on the compute stream (wait); the host
//      never blocks on the GPU (the disk tier's Wait blocks only until the file read was
//      issued).
//
// Host memory: weights in pinned blocks (host_logic.h: WeightPacker) read from the data file
// straight into pinned memory; stored activations in a pinned SlotRing whose slots are
// reused only after the copy that reads them completed (the slot's fence is that copy's
// event); disk-tier reads go through pinned staging buffers on the disk channel's I/O
// threads. Nothing is allocated or created per run once a session ran once.
//
// The engine's parts: device.h (per-device streams, event pools, device and pinned
// staging), pinned_weights.h (the host store of weights), records.h (stored activations in
// the ring, loads in flight), streamed_load.{h,cc} (chunked reads of the disk tier),
// timing.{h,cc} (copy timing, the fault hooks' spin), calibrate.cc (the C API's CUDA helpers).
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "../channel.h"
#include "../common.h"
#include "../disk_io.h"
#include "../engine.h"
#include "../fault_hooks.h"
#include "../run_records.h"
#include "../tiers.h"
#include "cuda_api.h"
#include "cuda_util.h"
#include "device.h"
#include "host_logic.h"
#include "kernels.h"
#include "pinned_weights.h"
#include "records.h"
#include "streamed_load.h"
#include "timing.h"

namespace ho {

namespace gpu {

namespace {

// Store keys are token addresses; ids written into tokens are unique in the process.
std::atomic<uint64_t> g_next_store_id{1};

class CudaEngine final : public Engine {
 public:
  CudaEngine() {
    int n = 0;
    check(cudaGetDeviceCount(&n), "cudaGetDeviceCount");
    if (n == 0) fail(ORT_FAIL, "no CUDA device");
    drain_->sync = [this] { sync_loads(); };
    counters().engines_alive += 1;
  }

  ~CudaEngine() override {
    // I/O threads first (queued disk jobs are dropped), then let every copy finish before
    // the pinned memory it reads goes away (the streams may be shared with other engines:
    // synchronizing them waits for their copies too, which is harmless).
    disk_.reset();
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& kv : devices_) {
        cuda::ignore(cudaStreamSynchronize(kv.second->h2d.get()));
        cuda::ignore(cudaStreamSynchronize(kv.second->d2h.get()));
      }
    }
    {
      Released released;
      records_.clear(&released);
    }
    ring_.reset();
    {
      std::lock_guard<std::mutex> lock(drain_->mu);
      drain_->sync = nullptr;  // the streams are synchronized: no copy reads a block now
    }
    weights_.reset();
    devices_.clear();
    counters().engines_alive -= 1;
  }

  void prepare_device(int device) override { (void)dev(device); }

  // Every weight copy issued so far is done (they are on the devices' h2d streams): what a
  // pinned weight block waits for before it is unpinned (CopyDrain).
  void sync_loads() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& kv : devices_) cuda::ignore(cudaStreamSynchronize(kv.second->h2d.get()));
  }

  void plan_host_bytes(size_t bytes) override {
    const size_t cap = cuda_logic::ring_capacity(bytes);
    std::lock_guard<std::mutex> lock(plan_mu_);
    if (cap <= planned_ring_) return;
    planned_ring_ = cap;
    ring_->reserve(cap);  // one pinned segment for a whole run, at session creation
  }

  std::shared_ptr<const HostBlob> load_weight(const WeightSource& src,
                                              const std::string& content) override {
    return weights_->load(src, content);
  }

  void prefetch_weight(const std::shared_ptr<const HostBlob>& blob, void* dst,
                       const ExecContext& ctx) override {
    // The pinned source is the engine's (never freed before the streams are synchronized).
    load_from_host(blob->data(), blob->size(), dst, ctx, "cudaMemcpyAsync (weight, host to device)");
  }

  void prefetch_input(const void* src, size_t bytes, void* dst, const ExecContext& ctx) override {
    // The caller's host memory (engine.h: pageable is staged before the call returns).
    load_from_host(src, bytes, dst, ctx, "cudaMemcpyAsync (graph input, host to device)");
  }

  void prepare_streamed() override {
    std::lock_guard<std::mutex> lock(disk_mu_);
    if (!disk_) disk_ = std::make_unique<Channel>("cuda-disk", disk_io_threads());
    has_disk_ = true;
  }

  void prefetch_streamed(const std::shared_ptr<const WeightSource>& w, void* dst,
                         const ExecContext& ctx) override {
    const size_t bytes = w->size();
    // The h2d stream waits for the staging buffer's last use here (HAZARD a); the chunk
    // copies are enqueued later by the I/O threads, hence after that wait in stream order.
    std::optional<Start> s = start_load(ctx, dst, bytes);
    if (!s) return;
    Pending& p = s->p;
    p.issued = std::make_shared<Completion>();
    p.cancelled = std::make_shared<std::atomic<bool>>(false);
    const Chunks c = chunks_of(*w, disk_chunk_for(bytes, disk_io_threads()));
    Device* dp = &s->d;
    add_pending(dst, p, ctx.kernel);
    auto t = std::make_shared<StreamedTransfer>(p, c.count(), dp);
    char* out = static_cast<char*>(p.stage->data());
    const int64_t delay = faults::delay_us();
    for (uint64_t pos = c.begin, q = 0; pos < c.end; pos = q) {
      q = c.after(pos);
      disk_->submit(
          [t, w, dp, pos, q, o = out + (pos - c.begin), delay, first = pos == c.begin] {
            std::string error;
            try {
              if (!t->stop()) read_chunk(*dp, *w, pos, q, o, first ? delay : 0);
            } catch (const std::exception& e) {
              error = std::string("disk channel: ") + e.what();
            }
            t->part_done(std::move(error));
          },
          nullptr);
    }
  }

  StoreKey store(const void* src, size_t bytes, std::vector<int64_t> shape,
                 ONNXTensorElementDataType type, const ExecContext& ctx) override {
    counters().stores += 1;
    Device& d = dev(ctx.device);
    const auto cs = static_cast<cudaStream_t>(ctx.stream);
    auto rec = std::make_shared<GpuStored>(std::move(shape), bytes, type, ring_);
    rec->device = d.id;
    rec->id = g_next_store_id.fetch_add(1);
    if (bytes != 0) {
      rec->slot = ring_->acquire(bytes);
      counters().host_pool_bytes_in_use += static_cast<int64_t>(bytes);
      // `x` is written by earlier kernels of the compute stream: the copy starts after them.
      // HAZARD (d).
      if (!faults::skip_store_start()) {
        Lease ready = d.events->acquire();
        check(cudaEventRecord(*ready, cs), "cudaEventRecord (store ready)");
        check(cudaStreamWaitEvent(d.d2h.get(), *ready, 0), "cudaStreamWaitEvent (store ready)");
      }  // the wait is enqueued: the event may be recorded again
      spin(faults::delay_us(), d.d2h.get());
      CopyTimer timer(d, d.d2h.get(), bytes, false);
      check(cudaMemcpyAsync(rec->slot->data, src, bytes, cudaMemcpyDeviceToHost, d.d2h.get()),
            "cudaMemcpyAsync (store, device to host)");
      timer.done();
      rec->stored = d.events->acquire();
      check(cudaEventRecord(*rec->stored, d.d2h.get()), "cudaEventRecord (store done)");
      counters().bytes_stored += bytes;
      counters().cuda_bytes_d2h += bytes;
    }
    if (ctx.out == nullptr) fail(ORT_FAIL, "store: no token output");
    check(cuda::launch_write_token(ctx.out, rec->id, kTokenMagic, cs), "token kernel launch");
    const uint64_t key = reinterpret_cast<uintptr_t>(ctx.out);
    Released released;  // (a record of a failed run at the same address is dropped)
    records_.put_stored(key, std::move(rec), nullptr, &released, ctx.kernel);
    return StoreKey{key, 0};
  }

  void detach(const StoreKey& skey, const ExecContext& ctx) override {
    const uint64_t key = skey.id;
    // When ORT did not alias token2, the record moves to its address (the copy below).
    const uint64_t to = ctx.out != nullptr ? reinterpret_cast<uintptr_t>(ctx.out) : key;
    Released released;
    std::shared_ptr<GpuStored> rec =
        records_.move_stored(key, to, nullptr, any_record, &released);
    if (!rec) {
      fail(ORT_INVALID_ARGUMENT, "token names no pending store of this run (not a Store "
                                 "output of this run and session, or already reloaded)");
    }
    (void)dev(ctx.device);  // makes the kernel's device current on this thread
    const auto cs = static_cast<cudaStream_t>(ctx.stream);
    // HAZARD (b): ORT may free `x` right after this op and hand its block to the next
    // allocation; the compute stream must not pass this point before the device-to-host
    // copy has read `x`.
    if (rec->stored && !faults::skip_detach_wait()) {
      check(cudaStreamWaitEvent(cs, *rec->stored, 0), "cudaStreamWaitEvent (detach)");
    }
    if (ctx.out != nullptr && reinterpret_cast<uintptr_t>(ctx.out) != key) {
      check(cudaMemcpyAsync(ctx.out, reinterpret_cast<const void*>(key), kTokenBytes,
                            cudaMemcpyDeviceToDevice, cs),
            "cudaMemcpyAsync (token)");
      counters().alias_copies += 1;
    }
  }

  std::shared_ptr<StoredTensor> take_stored(const StoreKey& skey,
                                            const ExecContext& ctx) override {
    Released released;
    std::shared_ptr<GpuStored> rec = records_.take_stored(skey.id, nullptr, any_record,
                                                          &released);
    if (!rec) {
      fail(ORT_INVALID_ARGUMENT,
           "token names no stored tensor of this run (already reloaded, from an earlier or "
           "failed run, or from another session)");
    }
    return rec;
  }

  void prefetch_stored(std::shared_ptr<StoredTensor> stored, void* dst,
                       const ExecContext& ctx) override {
    auto rec = std::static_pointer_cast<GpuStored>(std::move(stored));
    std::optional<Start> s = start_load(ctx, dst, rec->bytes());
    if (!s) return;
    Device& d = s->d;
    Pending& p = s->p;
    // The host copy must be complete (the store's d2h copy) before it is read back.
    check(cudaStreamWaitEvent(d.h2d.get(), *rec->stored, 0), "cudaStreamWaitEvent (stored)");
    copy_from_host(d, p, rec->slot->data, "cudaMemcpyAsync (stored, host to device)");
    // The slot is reused only after this copy read it (its fence is `done`).
    rec->release_slot(p.done);
    add_pending(dst, std::move(p), ctx.kernel);
  }

  void forget_kernel(const void* kernel) noexcept override {
    try {
      Released released;  // (destroyed after the records' lock is let go)
      records_.forget(kernel, &released);
    } catch (...) {  // (out of memory for the list: the records go with the engine)
    }
  }

  uint64_t enter_run(const void* kernel, bool per_iteration) override {
    Released released;  // (an earlier run's records: released after the lock is let go)
    return records_.enter(kernel, &released, per_iteration).epoch;
  }

  void wait(const void* dst, void* /*out: ctx.out*/, size_t bytes,
            const ExecContext& ctx) override {
    if (bytes == 0) return;
    Pending p;
    {
      Released released;
      std::optional<Pending> found = records_.take_load(dst, nullptr, &released);
      if (!found) {
        fail(ORT_FAIL, "no transfer pending for input (already waited, or not a Prefetch "
                       "output of this run)");
      }
      p = std::move(*found);
    }
    const auto cs = static_cast<cudaStream_t>(ctx.stream);
    counters().waits += 1;
    if (p.issued) {
      // Disk tier: the host waits until the file was read and the last copy enqueued (the
      // event is recorded by then); the copies themselves are waited for on the stream.
      const auto t0 = std::chrono::steady_clock::now();
      const std::string error = p.issued->wait();
      counters().wait_ns += static_cast<uint64_t>(
          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
              .count());
      if (!error.empty()) fail(ORT_FAIL, "transfer failed: " + error);
    }
    if (p.bytes != bytes) {
      fail(ORT_FAIL, "input holds " + std::to_string(bytes) + " bytes but its Prefetch loads " +
                         std::to_string(p.bytes));
    }
    Device& d = dev(ctx.device);
    void* z = ctx.out != nullptr ? ctx.out : const_cast<void*>(dst);
    if (z != dst) counters().alias_copies += 1;
    // HAZARD (c): the copy into `z` runs on the compute stream after the load landed in
    // staging (a stream-side wait only: the host returns at once). `z` is ORT's, written in
    // this op's stream order: the lifetime rule holds on the GPU. The test hook removes the
    // wait only (the copy still runs, and reads the poison when it runs too early).
    if (!faults::skip_wait_event() &&
        !faults::skip_wait()) {
      check(cudaStreamWaitEvent(cs, *p.done, 0), "cudaStreamWaitEvent (wait)");
    }
    // Test hook: the compute stream reaches this copy late, so a next load that does not
    // wait for the staging fence (a) overwrites the buffer before the copy read it.
    spin(faults::compute_delay_us(), cs);
    check(cudaMemcpyAsync(z, p.stage->data(), bytes, cudaMemcpyDeviceToDevice, cs),
          "cudaMemcpyAsync (staging to wait output)");
    counters().cuda_bytes_d2d += bytes;
    if (faults::poison()) {
      // Test hook: between its uses a staging buffer holds 0xFF, so a copy out of it that
      // is not ordered after its load (c), or a load not ordered after the previous read
      // (a), shows as NaN instead of stale but plausible bytes.
      check(cudaMemsetAsync(p.stage->data(), 0xFF, bytes, cs), "cudaMemsetAsync (poison)");
    }
    // The staging buffer is reused only after this copy read it.
    Lease read = d.events->acquire();
    check(cudaEventRecord(*read, cs), "cudaEventRecord (staging read)");
    p.stage->fence = std::move(read);
  }

 private:
  Device& dev(int device) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = devices_.find(device);
    if (it == devices_.end()) it = devices_.emplace(device, shared_device(device)).first;
    Device& d = *it->second;
    if (has_disk_.load()) d.need_staging();
    cuda::set_device(device);  // this thread's current device for the calls that follow
    return d;
  }

  // One cudaMemcpyAsync of `bytes` at host `src` into staging on the load stream (the
  // hardware's rate from pinned memory), registered as the load of `dst`.
  void load_from_host(const void* src, size_t bytes, void* dst, const ExecContext& ctx,
                      const char* what) {
    std::optional<Start> s = start_load(ctx, dst, bytes);
    if (!s) return;
    copy_from_host(s->d, s->p, src, what);
    add_pending(dst, std::move(s->p), ctx.kernel);
  }

  // A load started for the Prefetch output `dst`, on the kernel's device (made current).
  struct Start {
    Device& d;
    Pending p;  // its staging buffer, bytes and completion event `done` (not yet recorded)
  };

  // The start every load shares (host, stored, streamed): the Prefetch counted; for
  // `bytes` != 0 the device staging the load lands in (begin_load) and its completion
  // event. Empty when there is nothing to load.
  std::optional<Start> start_load(const ExecContext& ctx, void* dst, size_t bytes) {
    counters().prefetches += 1;
    if (bytes == 0) return std::nullopt;
    Device& d = dev(ctx.device);
    Pending p;
    p.stage = begin_load(d, static_cast<cudaStream_t>(ctx.stream), dst, bytes);
    p.bytes = bytes;
    p.done = d.events->acquire();
    return Start{d, std::move(p)};
  }

  // The load `p`'s copy of its bytes from host `src` (pinned: the hardware's rate) into its
  // staging on the load stream, then its completion event.
  static void copy_from_host(Device& d, Pending& p, const void* src, const char* what) {
    spin(faults::delay_us(), d.h2d.get());
    CopyTimer timer(d, d.h2d.get(), p.bytes, true);
    check(cudaMemcpyAsync(p.stage->data(), src, p.bytes, cudaMemcpyHostToDevice, d.h2d.get()),
          what);
    timer.done();
    check(cudaEventRecord(*p.done, d.h2d.get()), "cudaEventRecord (load done)");
    counters().bytes_loaded += p.bytes;
    counters().cuda_bytes_h2d += p.bytes;
  }

  // A load for the Prefetch output `dst` (a freshly allocated output of the compute stream
  // `cs`): returns the staging buffer it lands in, the load stream already ordered after
  // the buffer's previous use.
  StageBuf begin_load(Device& d, cudaStream_t cs, void* dst, size_t bytes) {
    {
      Released stale;  // a load of a failed run for the same block, never waited for
      records_.drop_load(dst, &stale);
    }
    spin(faults::compute_delay_us(), cs);
    if (faults::poison()) {
      check(cudaMemsetAsync(dst, 0xFF, bytes, cs), "cudaMemsetAsync (poison)");
    }
    // HAZARD (a), now on the staging buffer: the copy never writes `dst` (ORT's), but it
    // must not overwrite a staging buffer before the last copy that used it (a Wait's copy
    // out of it on some compute stream, or a load of a failed run) is done.
    StageBuf sb = d.loads->acquire(bytes);
    if (sb->fence && !faults::skip_staging_fence()) {
      check(cudaStreamWaitEvent(d.h2d.get(), *sb->fence, 0), "cudaStreamWaitEvent (staging reuse)");
    }
    sb->fence.reset();  // the wait is enqueued: the event may go back to the pool
    return sb;
  }

  // `creator`: the calling kernel (its records go with it: forget_kernel); the op entered
  // its run at the start of its Compute (Engine::enter_run).
  void add_pending(const void* dst, Pending p, const void* creator) {
    Released released;
    records_.put_load(dst, std::move(p), nullptr, &released, creator);
  }

  static bool any_record(const GpuStored&) { return true; }  // (the key is an address)

  std::mutex mu_;
  std::map<int, std::shared_ptr<Device>> devices_;
  Records records_{process_threads()};  // stored: keyed by token address
  std::mutex plan_mu_;
  size_t planned_ring_ = 0;
  std::shared_ptr<Ring> ring_ = std::make_shared<Ring>(
      [](size_t bytes) { return std::make_unique<PinnedRingMemory>(bytes); },
      cuda_logic::kRingAlign, cuda_logic::kRingGrowth);
  std::shared_ptr<CopyDrain> drain_ = std::make_shared<CopyDrain>();
  std::unique_ptr<PinnedWeights> weights_ = std::make_unique<PinnedWeights>(drain_);
  std::mutex disk_mu_;  // guards disk_ / has_disk_
  std::atomic<bool> has_disk_{false};  // set at session creation by a streamed weight
  std::unique_ptr<Channel> disk_;
};

}  // namespace

}  // namespace gpu

std::shared_ptr<Engine> make_cuda_engine() { return std::make_shared<gpu::CudaEngine>(); }

}  // namespace ho
