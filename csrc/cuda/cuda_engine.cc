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
#include <cuda_runtime.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../channel.h"
#include "../common.h"
#include "../disk_io.h"
#include "../engine.h"
#include "../fault_hooks.h"
#include "../run_records.h"
#include "../tiers.h"
#include "../weak_cache.h"
#include "cuda_api.h"
#include "cuda_util.h"
#include "host_logic.h"
#include "kernels.h"

namespace ho {

namespace {

using cuda::check;
using cuda_logic::EventPool;
using cuda_logic::SlotRing;

// Store keys are token addresses; ids written into tokens are unique in the process.
std::atomic<uint64_t> g_next_store_id{1};

// Events without timing (cheapest to record and wait on).
struct EventTraits {
  using Event = cudaEvent_t;
  int device = 0;
  bool timing = false;
  cudaEvent_t create() const {
    cuda::set_device(device);
    cudaEvent_t e = nullptr;
    check(cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming),
          "cudaEventCreateWithFlags");
    counters().cuda_events_created += 1;
    return e;
  }
  void destroy(cudaEvent_t e) const noexcept { cuda::ignore(cudaEventDestroy(e)); }
};
using Pool = EventPool<EventTraits>;
using Lease = Pool::Lease;

// A ring slot's fence: the event of the last copy that reads the slot.
struct EventFence {
  Lease ev;
  bool ready() const {
    const cudaError_t e = cudaEventQuery(*ev);
    if (e == cudaErrorNotReady) return false;
    // cudaSuccess, or an error that will never let the copy finish (the context is lost):
    // the slot cannot be read any more either way.
    if (e != cudaSuccess) (void)cudaGetLastError();
    return true;
  }
};
using Ring = SlotRing<EventFence>;

class PinnedRingMemory final : public cuda_logic::RingMemory {
 public:
  explicit PinnedRingMemory(size_t bytes) : block_(bytes) {
    counters().host_pool_bytes_reserved += static_cast<int64_t>(bytes);
    counters().ring_segments += 1;
  }
  ~PinnedRingMemory() override {
    counters().host_pool_bytes_reserved -= static_cast<int64_t>(block_.size());
    counters().ring_segments -= 1;
  }
  char* data() override { return block_.data(); }

 private:
  cuda::PinnedBlock block_;
};

// ---- transfer timing (benchmarks) ------------------------------------------------------
struct TimedCopy {
  Lease start, end;
  uint64_t bytes;
  bool h2d;
  int device;
};
std::mutex g_times_mu;
std::vector<TimedCopy>* g_times = new std::vector<TimedCopy>();  // never freed (exit order)
CudaTransferTimes g_times_done;

// ---- per device --------------------------------------------------------------------------

// Pinned staging buffers for disk reads; each one is reused only after the copy out of it
// completed (host-side event sync on an I/O thread, never on a compute thread).
class Staging {
 public:
  struct Buf {
    Buf() = default;
    Buf(const Buf&) = delete;
    Buf& operator=(const Buf&) = delete;
    // RAII: also on a constructor error path of Staging (the buffers made so far).
    ~Buf() {
      if (ev == nullptr) return;
      if (recorded) cuda::ignore(cudaEventSynchronize(ev));  // the copy reading `mem`
      cuda::ignore(cudaEventDestroy(ev));
    }
    std::unique_ptr<cuda::PinnedBlock> mem;
    cudaEvent_t ev = nullptr;
    bool recorded = false;
  };
  Staging(int device, size_t count, size_t bytes) : device_(device) {
    cuda::set_device(device);
    for (size_t i = 0; i < count; ++i) {
      auto b = std::make_unique<Buf>();
      b->mem = std::make_unique<cuda::PinnedBlock>(bytes);
      check(cudaEventCreateWithFlags(&b->ev, cudaEventDisableTiming), "cudaEventCreateWithFlags");
      counters().cuda_events_created += 1;
      free_.push_back(b.get());
      all_.push_back(std::move(b));
    }
  }
  ~Staging() = default;  // each Buf waits for its last copy, then frees its event
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;

  Buf* acquire() {
    Buf* b = nullptr;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return !free_.empty(); });
      b = free_.back();
      free_.pop_back();
    }
    if (b->recorded) {
      const cudaError_t e = cudaEventSynchronize(b->ev);
      if (e != cudaSuccess) {
        release(b);
        check(e, "cudaEventSynchronize (disk staging)");
      }
      b->recorded = false;
    }
    return b;
  }
  void release(Buf* b) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      free_.push_back(b);
    }
    cv_.notify_one();
  }
  int device() const { return device_; }

 private:
  int device_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Buf*> free_;
  std::vector<std::unique_ptr<Buf>> all_;
};

// Device staging of loads (the transfer lifetime rule, docs/design.md): a Prefetch's copy
// lands here, never in ORT's Prefetch output, and the Wait copies it into its own output on
// the compute stream. A failed run's copy therefore writes only memory of the library.
// Buffers are reused by size; each carries a fence, the event after the last copy that
// wrote or read it, and its next writer makes its stream wait on that fence first (a
// stream-side wait: the host never blocks). Nothing is allocated per run once warm.
class DeviceStaging : public std::enable_shared_from_this<DeviceStaging> {
 public:
  class Buf {
   public:
    Buf(std::shared_ptr<DeviceStaging> pool, std::unique_ptr<cuda::DeviceBuffer> mem,
        size_t bytes, Lease fence)
        : fence(std::move(fence)), pool_(std::move(pool)), mem_(std::move(mem)), bytes_(bytes) {}
    ~Buf() { pool_->release(std::move(mem_), bytes_, std::move(fence)); }
    Buf(const Buf&) = delete;
    Buf& operator=(const Buf&) = delete;
    void* data() const { return mem_->data(); }

    Lease fence;  // the last copy that used the buffer (set by that copy's issuer)

   private:
    std::shared_ptr<DeviceStaging> pool_;
    std::unique_ptr<cuda::DeviceBuffer> mem_;
    size_t bytes_;
  };

  explicit DeviceStaging(int device) : device_(device) {}
  ~DeviceStaging() {
    for (auto& kv : free_) {
      if (kv.second.second) cuda::ignore(cudaEventSynchronize(*kv.second.second));
    }
    counters().device_staging_bytes -= static_cast<int64_t>(held_);
  }
  DeviceStaging(const DeviceStaging&) = delete;
  DeviceStaging& operator=(const DeviceStaging&) = delete;

  // A buffer of `bytes` bytes; its `fence` (if set) must be waited for by the writer's stream.
  std::shared_ptr<Buf> acquire(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.find(bytes);
      if (it != free_.end()) {
        auto entry = std::move(it->second);
        free_.erase(it);
        return std::make_shared<Buf>(shared_from_this(), std::move(entry.first), bytes,
                                     std::move(entry.second));
      }
    }
    auto mem = std::make_unique<cuda::DeviceBuffer>(device_, bytes);
    counters().device_staging_bytes += static_cast<int64_t>(bytes);
    {
      std::lock_guard<std::mutex> lock(mu_);
      held_ += bytes;
    }
    return std::make_shared<Buf>(shared_from_this(), std::move(mem), bytes, Lease());
  }

 private:
  void release(std::unique_ptr<cuda::DeviceBuffer> mem, size_t bytes, Lease fence) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.emplace(bytes, std::make_pair(std::move(mem), std::move(fence)));
  }

  int device_;
  std::mutex mu_;
  size_t held_ = 0;  // bytes of every buffer made (device_staging_bytes' share of this pool)
  std::multimap<size_t, std::pair<std::unique_ptr<cuda::DeviceBuffer>, Lease>> free_;
};
using StageBuf = std::shared_ptr<DeviceStaging::Buf>;

// The copy streams and event pools of one device, shared by every engine of the process
// (shared_device): one FIFO per direction and device, like the hardware's copy engines.
struct Device {
  explicit Device(int dev)
      : id(dev),
        h2d(dev),
        d2h(dev),
        events(std::make_shared<Pool>(EventTraits{dev, false})),
        timing(std::make_shared<Pool>(EventTraits{dev, true})),
        loads(std::make_shared<DeviceStaging>(dev)) {
    events->prewarm(64);
  }
  const int id;
  cuda::Stream h2d;  // the load channel: host-to-device copies, FIFO
  cuda::Stream d2h;  // the store channel: device-to-host copies, FIFO
  std::shared_ptr<Pool> events;
  std::shared_ptr<Pool> timing;
  std::shared_ptr<DeviceStaging> loads;  // device staging of loads (lifetime rule)
  std::mutex staging_mu;
  std::unique_ptr<Staging> staging;  // created when an engine has disk-tier weights

  Staging& need_staging() {
    std::lock_guard<std::mutex> lock(staging_mu);
    if (!staging) {
      // Two pinned chunk buffers per I/O thread: one read while the other is copied.
      staging = std::make_unique<Staging>(id, 2 * static_cast<size_t>(disk_io_threads()),
                                          disk_chunk_bytes());
    }
    return *staging;
  }
};

std::shared_ptr<Device> shared_device(int device) {
  static std::mutex mu;
  static auto* devices = new std::map<int, std::weak_ptr<Device>>();  // never freed
  std::lock_guard<std::mutex> lock(mu);
  std::weak_ptr<Device>& slot = (*devices)[device];
  std::shared_ptr<Device> d = slot.lock();
  if (!d) {
    d = std::make_shared<Device>(device);
    slot = d;
  }
  return d;
}

// ---- host store of weights ------------------------------------------------------------

class PinnedBlob final : public HostBlob {
 public:
  PinnedBlob(std::shared_ptr<cuda::PinnedBlock> block, char* p, size_t size)
      : block_(std::move(block)), p_(p), size_(size) {
    counters().host_store_bytes += static_cast<int64_t>(size_);
  }
  ~PinnedBlob() override { counters().host_store_bytes -= static_cast<int64_t>(size_); }
  const void* data() const override { return p_; }
  size_t size() const override { return size_; }

 private:
  std::shared_ptr<cuda::PinnedBlock> block_;
  char* p_;
  size_t size_;
};

// What must happen before a pinned weight block is unpinned: every copy that may read it
// done (a failed run's load can still be in flight when its session goes). `sync` is the
// engine's (it synchronizes its copy streams); empty once the engine has synchronized them
// for good at its end.
struct CopyDrain {
  std::mutex mu;
  std::function<void()> sync;
};

// Weights in pinned host memory, keyed by content (Registration::content_key: a data file
// rewritten in place is never served from an earlier version's bytes) and held only while a
// session's kernels hold them: a hot-swapped version's weights go with its last session.
// Small weights are packed into shared chunks (WeightPacker); a block is unpinned when its
// last weight goes, after the copy streams are drained.
class PinnedWeights {
 public:
  explicit PinnedWeights(std::shared_ptr<CopyDrain> drain) : drain_(std::move(drain)) {}

  std::shared_ptr<const HostBlob> load(const WeightSource& src, const std::string& content) {
    return blobs_.get(weight_key(src, content),
                      [&]() -> std::shared_ptr<const HostBlob> { return place(src); });
  }

 private:
  // Pins `src`'s bytes (under the cache's lock: the packer's chunk is shared).
  std::shared_ptr<const HostBlob> place(const WeightSource& src) {
    const size_t n = src.size();
    const cuda_logic::WeightPacker::Placement p = packer_.place(n);
    std::shared_ptr<cuda::PinnedBlock> block;
    char* dst = nullptr;
    if (p.own_block) {
      block = pinned(p.block_bytes);
      dst = block->data();
    } else {
      if (p.block_bytes != 0) chunk_ = pinned(p.block_bytes);
      block = chunk_;
      dst = block->data() + p.offset;
    }
    // Straight into pinned memory: no pageable copy in between.
    if (n != 0) src.read(src.offset(), n, dst);
    return std::make_shared<PinnedBlob>(std::move(block), dst, n);
  }

  // A pinned block whose release first drains the copy streams.
  std::shared_ptr<cuda::PinnedBlock> pinned(size_t bytes) {
    std::shared_ptr<CopyDrain> drain = drain_;
    return std::shared_ptr<cuda::PinnedBlock>(
        new cuda::PinnedBlock(bytes), [drain](cuda::PinnedBlock* b) {
          {
            std::lock_guard<std::mutex> lock(drain->mu);
            if (drain->sync) drain->sync();
          }
          delete b;
        });
  }

  std::shared_ptr<CopyDrain> drain_;
  cuda_logic::WeightPacker packer_;
  std::shared_ptr<cuda::PinnedBlock> chunk_;  // the chunk small weights are packed into
  WeakCache<const HostBlob> blobs_;
};

// ---- records -------------------------------------------------------------------------

class GpuStored final : public StoredTensor {
 public:
  GpuStored(std::vector<int64_t> shape, size_t bytes, ONNXTensorElementDataType type,
            std::shared_ptr<Ring> ring)
      : shape_(std::move(shape)), bytes_(bytes), type_(type), ring_(std::move(ring)) {}
  ~GpuStored() override { release_slot(stored); }
  const std::vector<int64_t>& shape() const override { return shape_; }
  size_t bytes() const override { return bytes_; }
  ONNXTensorElementDataType elem_type() const override { return type_; }

  // The slot returns to the ring; reused once `fence` (the last copy reading it) is done.
  void release_slot(const Lease& fence) {
    if (!slot) return;
    std::optional<EventFence> f;
    if (fence) f = EventFence{fence};
    ring_->release(*slot, std::move(f));
    slot.reset();
    counters().host_pool_bytes_in_use -= static_cast<int64_t>(bytes_);
  }

  std::optional<Ring::Slot> slot;
  Lease stored;  // recorded on the d2h stream after the copy into the slot
  int device = 0;
  uint64_t id = 0;
  Owner owner;  // the run that stored it (run_records.h)

 private:
  std::vector<int64_t> shape_;
  size_t bytes_;
  ONNXTensorElementDataType type_;
  std::shared_ptr<Ring> ring_;
};

// A load in flight, keyed by its destination. `done` is recorded on the h2d stream after
// the last copy; for a disk load it is recorded by an I/O thread, and `issued` tells the
// host when that happened (with the read's error, if any).
struct Pending {
  Lease done;
  StageBuf stage;  // where the load lands (device staging of the engine)
  size_t bytes = 0;
  CompletionPtr issued;  // disk tier only
  std::shared_ptr<std::atomic<bool>> cancelled;  // disk tier only
  Owner owner;  // the run of its Prefetch (run_records.h)

  // Released without its Wait (a failed run's load): it writes only its own staging buffer
  // (released with its fence when its last copy is enqueued); a disk load stops issuing
  // more copies.
  void abandon() {
    if (cancelled) cancelled->store(true);
  }
};

using Records = RunRecords<GpuStored, Pending>;
using Released = Records::Released;

// One disk transfer split into chunks; the part that finishes last records `done`.
class GpuDiskTransfer {
 public:
  GpuDiskTransfer(Pending p, size_t parts, Device* dev)
      : p_(std::move(p)), remaining_(parts), dev_(dev) {}
  ~GpuDiskTransfer() {
    if (remaining_ != 0 && error_.empty()) error_ = "disk channel: transfer cancelled";
    if (!finished_) p_.issued->finish(std::move(error_));
  }
  GpuDiskTransfer(const GpuDiskTransfer&) = delete;
  GpuDiskTransfer& operator=(const GpuDiskTransfer&) = delete;

  bool stop() {
    std::lock_guard<std::mutex> lock(mu_);
    return !error_.empty() || p_.cancelled->load();
  }
  // Called after the part's copy was enqueued (or failed).
  void part_done(std::string error) {
    std::lock_guard<std::mutex> lock(mu_);
    if (error_.empty() && !error.empty()) error_ = std::move(error);
    if (--remaining_ != 0) return;
    // Every copy of this transfer is enqueued: `done` follows them on the h2d stream.
    cudaError_t e = cudaSetDevice(dev_->id);
    if (e == cudaSuccess) e = cudaEventRecord(*p_.done, dev_->h2d.get());
    if (e != cudaSuccess && error_.empty()) {
      error_ = std::string("CUDA error in cudaEventRecord (disk load): ") + cudaGetErrorString(e);
      (void)cudaGetLastError();
    }
    // The staging buffer's fence until a Wait copies out of it (then: that copy's event).
    if (p_.stage) p_.stage->fence = p_.done;
    finished_ = true;
    p_.issued->finish(error_);
  }

 private:
  Pending p_;
  std::mutex mu_;
  std::string error_;
  size_t remaining_;
  bool finished_ = false;
  Device* dev_;
};

void spin(int64_t us, cudaStream_t s) {
  if (us > 0) check(cuda::launch_spin(us * 1000, s), "spin kernel launch (debug hook)");
}

// Record timing events around a copy when tracing().cuda_timing is on.
class CopyTimer {
 public:
  CopyTimer(Device& d, cudaStream_t s, uint64_t bytes, bool h2d)
      : s_(s), bytes_(bytes), h2d_(h2d), device_(d.id) {
    if (!tracing().cuda_timing.load(std::memory_order_relaxed)) return;
    start_ = d.timing->acquire();
    end_ = d.timing->acquire();
    check(cudaEventRecord(*start_, s_), "cudaEventRecord (timing)");
  }
  void done() {
    if (!start_) return;
    check(cudaEventRecord(*end_, s_), "cudaEventRecord (timing)");
    std::lock_guard<std::mutex> lock(g_times_mu);
    g_times->push_back(TimedCopy{std::move(start_), std::move(end_), bytes_, h2d_, device_});
  }

 private:
  cudaStream_t s_;
  uint64_t bytes_;
  bool h2d_;
  int device_;
  Lease start_, end_;
};

// ---- the engine ---------------------------------------------------------------------

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
    counters().prefetches += 1;
    const size_t bytes = w->size();
    if (bytes == 0) return;
    Device& d = dev(ctx.device);
    const auto cs = static_cast<cudaStream_t>(ctx.stream);
    // The h2d stream waits for the compute stream here (HAZARD a); the chunk copies are
    // enqueued later by the I/O threads, hence after that wait in stream order.
    Pending p;
    p.stage = begin_load(d, cs, dst, bytes);
    p.bytes = bytes;
    p.done = d.events->acquire();
    p.issued = std::make_shared<Completion>();
    p.cancelled = std::make_shared<std::atomic<bool>>(false);
    const uint64_t chunk = disk_chunk_bytes();
    const uint64_t begin = w->offset();
    const uint64_t end = begin + bytes;
    const size_t parts = static_cast<size_t>((end - 1) / chunk - begin / chunk + 1);
    Device* dp = &d;
    add_pending(dst, p, ctx.kernel, ctx.kernel);
    auto t = std::make_shared<GpuDiskTransfer>(p, parts, dp);
    char* out = static_cast<char*>(p.stage->data());
    uint64_t pos = begin;
    const int64_t delay = faults::delay_us();
    for (size_t i = 0; i < parts; ++i) {
      const uint64_t q = std::min(end, (pos / chunk + 1) * chunk);
      disk_->submit(
          [t, w, dp, pos, q, o = out + (pos - begin), delay, first = i == 0] {
            std::string error;
            try {
              if (!t->stop()) disk_part(*dp, *w, pos, q, o, first ? delay : 0);
            } catch (const std::exception& e) {
              error = std::string("disk channel: ") + e.what();
            }
            t->part_done(std::move(error));
          },
          nullptr);
      pos = q;
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
    records_.put_stored(key, std::move(rec), ctx.kernel, &released, ctx.kernel);
    return StoreKey{key, 0};
  }

  void detach(const StoreKey& skey, const ExecContext& ctx) override {
    const uint64_t key = skey.id;
    // When ORT did not alias token2, the record moves to its address (the copy below).
    const uint64_t to = ctx.out != nullptr ? reinterpret_cast<uintptr_t>(ctx.out) : key;
    Released released;
    std::shared_ptr<GpuStored> rec =
        records_.move_stored(key, to, ctx.kernel, any_record, &released);
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
    std::shared_ptr<GpuStored> rec = records_.take_stored(skey.id, ctx.kernel, any_record,
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
    counters().prefetches += 1;
    auto rec = std::static_pointer_cast<GpuStored>(std::move(stored));
    const size_t bytes = rec->bytes();
    if (bytes == 0) return;
    Device& d = dev(ctx.device);
    const auto cs = static_cast<cudaStream_t>(ctx.stream);
    Pending p;
    p.stage = begin_load(d, cs, dst, bytes);
    p.bytes = bytes;
    // The host copy must be complete (the store's d2h copy) before it is read back.
    check(cudaStreamWaitEvent(d.h2d.get(), *rec->stored, 0), "cudaStreamWaitEvent (stored)");
    p.done = d.events->acquire();
    spin(faults::delay_us(), d.h2d.get());
    CopyTimer timer(d, d.h2d.get(), bytes, true);
    check(cudaMemcpyAsync(p.stage->data(), rec->slot->data, bytes, cudaMemcpyHostToDevice,
                          d.h2d.get()),
          "cudaMemcpyAsync (stored, host to device)");
    timer.done();
    check(cudaEventRecord(*p.done, d.h2d.get()), "cudaEventRecord (load done)");
    counters().bytes_loaded += bytes;
    counters().cuda_bytes_h2d += bytes;
    // The slot is reused only after this copy read it (its fence is `done`).
    rec->release_slot(p.done);
    add_pending(dst, std::move(p), nullptr, ctx.kernel);  // take_stored entered the run
  }

  void forget_kernel(const void* kernel) noexcept override {
    try {
      Released released;  // (destroyed after the records' lock is let go)
      records_.forget(kernel, &released);
    } catch (...) {  // (out of memory for the list: the records go with the engine)
    }
  }

  void wait(const void* dst, void* /*out: ctx.out*/, size_t bytes,
            const ExecContext& ctx) override {
    if (bytes == 0) return;
    Pending p;
    {
      Released released;
      std::optional<Pending> found = records_.take_load(dst, ctx.kernel, &released);
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
    counters().prefetches += 1;
    if (bytes == 0) return;
    Device& d = dev(ctx.device);
    const auto cs = static_cast<cudaStream_t>(ctx.stream);
    Pending p;
    p.stage = begin_load(d, cs, dst, bytes);
    p.bytes = bytes;
    p.done = d.events->acquire();
    spin(faults::delay_us(), d.h2d.get());
    CopyTimer timer(d, d.h2d.get(), bytes, true);
    check(cudaMemcpyAsync(p.stage->data(), src, bytes, cudaMemcpyHostToDevice, d.h2d.get()), what);
    timer.done();
    check(cudaEventRecord(*p.done, d.h2d.get()), "cudaEventRecord (load done)");
    counters().bytes_loaded += bytes;
    counters().cuda_bytes_h2d += bytes;
    add_pending(dst, std::move(p), ctx.kernel, ctx.kernel);
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

  // `kernel`: ctx.kernel when this is the op's first call into the engine, else null;
  // `creator`: the calling kernel (its records go with it: forget_kernel).
  void add_pending(const void* dst, Pending p, const void* kernel, const void* creator) {
    Released released;
    records_.put_load(dst, std::move(p), kernel, &released, creator);
  }

  static bool any_record(const GpuStored&) { return true; }  // (the key is an address)

  // One chunk of a streamed load, on an I/O thread: source -> pinned staging -> dst.
  static void disk_part(Device& d, const WeightSource& w, uint64_t p, uint64_t q, char* dst,
                        int64_t delay_us) {
    cuda::set_device(d.id);  // an I/O thread: every CUDA call below is on d's device
    Staging& staging = d.need_staging();
    Staging::Buf* b = staging.acquire();
    struct Back {
      Staging& s;
      Staging::Buf* b;
      ~Back() { s.release(b); }
    } back{staging, b};
    const size_t n = static_cast<size_t>(q - p);
    w.read(p, n, b->mem->data());
    counters().bytes_loaded += n;
    spin(delay_us, d.h2d.get());
    CopyTimer timer(d, d.h2d.get(), n, true);
    check(cudaMemcpyAsync(dst, b->mem->data(), n, cudaMemcpyHostToDevice, d.h2d.get()),
          "cudaMemcpyAsync (disk chunk, host to device)");
    counters().cuda_bytes_h2d += n;
    timer.done();
    check(cudaEventRecord(b->ev, d.h2d.get()), "cudaEventRecord (staging)");
    b->recorded = true;
  }

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

std::shared_ptr<Engine> make_cuda_engine() { return std::make_shared<CudaEngine>(); }

void cuda_set_device(int device) { cuda::set_device(device); }

CudaMemInfo cuda_mem_info(int device) {
  cuda::set_device(device);
  CudaMemInfo m;
  check(cudaMemGetInfo(&m.free_bytes, &m.total_bytes), "cudaMemGetInfo");
  return m;
}

CudaCalibration cuda_calibrate(size_t bytes, int device, int repeats) {
  if (bytes == 0) fail(ORT_INVALID_ARGUMENT, "cuda_calibrate: bytes must be > 0");
  repeats = std::max(1, repeats);
  cuda::set_device(device);
  CudaCalibration c;
  c.bytes = bytes;
  c.device = device;
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  c.device_name = prop.name;
  cuda::PinnedBlock host(bytes);
  std::memset(host.data(), 1, bytes);
  cuda::DeviceBuffer dev(device, bytes);
  cuda::Stream s(device);
  cuda::TimingEvent a, b;
  // The best copy of `repeats`, taken in four groups 50 ms apart after a warm-up: on the
  // H100 the rate of single 256 MiB copies dipped to 45-48 GB/s for tens of milliseconds at a
  // time (a shared host) while the engine's copies ran at 54.8; one short burst of copies
  // measured a dip (docs/benchmarks.md).
  const int per_group = std::max(1, (repeats + 3) / 4);
  auto rate = [&](bool h2d) {
    float best_ms = 0;
    for (int r = 0; r <= repeats; ++r) {  // r == 0: warm-up
      if (r > 1 && (r - 1) % per_group == 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      check(cudaEventRecord(a.get(), s.get()), "cudaEventRecord");
      if (h2d) {
        check(cudaMemcpyAsync(dev.data(), host.data(), bytes, cudaMemcpyHostToDevice, s.get()),
              "cudaMemcpyAsync");
      } else {
        check(cudaMemcpyAsync(host.data(), dev.data(), bytes, cudaMemcpyDeviceToHost, s.get()),
              "cudaMemcpyAsync");
      }
      check(cudaEventRecord(b.get(), s.get()), "cudaEventRecord");
      check(cudaEventSynchronize(b.get()), "cudaEventSynchronize");
      float ms = 0;
      check(cudaEventElapsedTime(&ms, a.get(), b.get()), "cudaEventElapsedTime");
      if (r > 0 && (best_ms == 0 || ms < best_ms)) best_ms = ms;
    }
    return best_ms > 0 ? static_cast<double>(bytes) / (best_ms * 1e-3) : 0.0;
  };
  c.h2d_bw = rate(true);
  c.d2h_bw = rate(false);
  return c;
}

CudaTransferTimes cuda_transfer_times(bool reset) {
  std::vector<TimedCopy> todo;
  {
    std::lock_guard<std::mutex> lock(g_times_mu);
    todo.swap(*g_times);
  }
  CudaTransferTimes add;
  for (TimedCopy& t : todo) {
    cuda::set_device(t.device);
    check(cudaEventSynchronize(*t.end), "cudaEventSynchronize (timing)");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, *t.start, *t.end), "cudaEventElapsedTime");
    if (t.h2d) {
      add.h2d_bytes += t.bytes;
      add.h2d_s += ms * 1e-3;
      add.h2d_copies += 1;
    } else {
      add.d2h_bytes += t.bytes;
      add.d2h_s += ms * 1e-3;
      add.d2h_copies += 1;
    }
  }
  std::lock_guard<std::mutex> lock(g_times_mu);
  g_times_done.h2d_bytes += add.h2d_bytes;
  g_times_done.h2d_s += add.h2d_s;
  g_times_done.h2d_copies += add.h2d_copies;
  g_times_done.d2h_bytes += add.d2h_bytes;
  g_times_done.d2h_s += add.d2h_s;
  g_times_done.d2h_copies += add.d2h_copies;
  CudaTransferTimes out = g_times_done;
  if (reset) g_times_done = CudaTransferTimes{};
  return out;
}

}  // namespace ho
