// CPU-EP engine: host store + host pool, and an I/O channel whose threads read streamed
// weights (the disk tier: tiers.h, disk_io.h) into library-owned staging buffers.
//
// Transfer lifetime rule (docs/design.md): no asynchronous work ever reads or writes memory
// that ORT owns. Every copy into or out of an ORT buffer happens inside the Compute call
// that was handed that buffer:
//  * Store copies its input into a pool buffer before it returns (Detach only checks);
//  * Prefetch only registers what its Wait will copy (a host-store weight, a stored tensor,
//    or a disk read that lands in a staging buffer of this engine);
//  * Wait copies from library memory into its own output before it returns.
// A failed run can therefore leave only library memory in flight; its records are owned by
// the run (run_records.h) and released at the latest when the next run on the same thread
// starts, or with the engine.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "channel.h"
#include "common.h"
#include "disk_io.h"
#include "engine.h"
#include "expert_cache.h"
#include "fault_hooks.h"
#include "host_memory.h"
#include "run_records.h"
#include "weak_cache.h"
#include "tiers.h"

namespace ho {

namespace {

// Store ids are unique in the process, so a token of another engine is never mistaken.
std::atomic<uint64_t> g_next_store_id{1};
void fault_delay() {
  const int64_t us = faults::delay_us();
  if (us > 0) std::this_thread::sleep_for(std::chrono::microseconds(us));
}

// A copy inside a Compute call: large ones are split over ORT's intra-op threads (idle while
// this kernel runs under the sequential executor), small ones are one memcpy.
struct CopyJob {
  char* dst;
  const char* src;
  size_t n;
  size_t chunk;
};

void copy_chunk(void* data, size_t i) {
  const auto* j = static_cast<const CopyJob*>(data);
  const size_t off = i * j->chunk;
  std::memcpy(j->dst + off, j->src + off, std::min(j->chunk, j->n - off));
}


class CpuStored final : public StoredTensor {
 public:
  CpuStored(std::vector<int64_t> shape, size_t bytes, ONNXTensorElementDataType type)
      : shape_(std::move(shape)), bytes_(bytes), type_(type) {}
  const std::vector<int64_t>& shape() const override { return shape_; }
  size_t bytes() const override { return bytes_; }
  ONNXTensorElementDataType elem_type() const override { return type_; }

  std::unique_ptr<PoolBuffer> buffer;  // null for zero bytes
  uint64_t tag = 0;
  Owner owner;

 private:
  std::vector<int64_t> shape_;
  size_t bytes_;
  ONNXTensorElementDataType type_;
};

// One streamed read (tiers.h) into a staging buffer of the engine, split into chunks served
// by the I/O threads. The chunk jobs hold the transfer (and so the staging buffer) until they ran:
// nothing they write is ORT's.
class DiskTransfer {
 public:
  DiskTransfer(std::unique_ptr<PoolBuffer> staging, size_t pad, size_t parts)
      : staging_(std::move(staging)), pad_(pad), remaining_(parts) {
    const uint64_t now = counters().disk_staging_bytes += staging_->size();
    uint64_t peak = counters().disk_staging_peak.load();
    while (now > peak && !counters().disk_staging_peak.compare_exchange_weak(peak, now)) {
    }
  }
  ~DiskTransfer() { counters().disk_staging_bytes -= staging_->size(); }
  DiskTransfer(const DiskTransfer&) = delete;
  DiskTransfer& operator=(const DiskTransfer&) = delete;

  char* data() const { return static_cast<char*>(staging_->data()) + pad_; }
  // Read by a warm (speculative) Prefetch and not yet asked for by a routed one.
  std::atomic<bool> warmed{false};
  bool failed() {
    std::lock_guard<std::mutex> lock(mu_);
    return !error_.empty();
  }
  void part_done(std::string error = {}) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (error_.empty() && !error.empty()) error_ = std::move(error);
      --remaining_;
    }
    cv_.notify_all();
  }
  // Blocks until every chunk ran; returns the first error ("" on success).
  std::string wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return remaining_ == 0; });
    return error_;
  }
  void cancel_remaining(size_t n, const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (error_.empty()) error_ = why;
      remaining_ -= n;
    }
    cv_.notify_all();
  }

 private:
  std::unique_ptr<PoolBuffer> staging_;
  size_t pad_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::string error_;
  size_t remaining_;
};

// A Prefetch waiting for its Wait: where the bytes come from (all library memory).
struct Pending {
  Owner owner;
  size_t bytes = 0;
  std::shared_ptr<const HostBlob> blob;    // host tier
  std::shared_ptr<CpuStored> stored;       // a stored activation
  std::shared_ptr<DiskTransfer> disk;      // a streamed tier (disk)
  const void* input = nullptr;             // a graph input of the run (read by its Wait)
  // A routed transfer: only these slices of `blob` (each slice_bytes) are copied.
  size_t slice_bytes = 0;
  std::vector<uint32_t> slices;
  // An expert-cache load: its cache and key (a failed read is dropped from it).
  std::shared_ptr<ExpertCache<DiskTransfer>> cache;
  std::string cache_key;

  // Released without its Wait: its chunk jobs still run, into the staging they hold.
  void abandon() {}
};

using Records = RunRecords<CpuStored, Pending>;

// Accepts a stored tensor whose tag is the token's (ids are guessable, tags are not).
struct Tagged {
  uint64_t tag;
  bool operator()(const CpuStored& rec) const { return rec.tag == tag; }
};
using Released = Records::Released;

class CpuEngine final : public Engine {
 public:
  explicit CpuEngine(const EngineLimits& limits)
      : pool_(std::make_shared<HostPool>(limits.host_pool_limit, "ho_onnx.host_pool_limit_bytes")),
        staging_(std::make_shared<HostPool>(0, "", kStagingAlign, false, false)) {
    std::random_device rd;
    rng_.seed((static_cast<uint64_t>(rd()) << 32) ^ rd() ^
              static_cast<uint64_t>(
                  std::chrono::steady_clock::now().time_since_epoch().count()));
    counters().engines_alive += 1;
  }

  ~CpuEngine() override {
    // Stop the disk channel first (queued jobs are dropped, running ones finish): they
    // write only into staging buffers they hold themselves.
    disk_.reset();
    {
      Released released;
      records_.clear(&released);
    }
    counters().engines_alive -= 1;
  }

  std::shared_ptr<const HostBlob> load_weight(const WeightSource& src,
                                              const std::string& content) override {
    return host_store_.load(src, content);
  }

  void prefetch_weight(const std::shared_ptr<const HostBlob>& blob, void* dst,
                       const ExecContext& ctx) override {
    counters().prefetches += 1;
    const size_t bytes = blob->size();
    Pending p;
    p.bytes = bytes;
    p.blob = blob;  // the host store's bytes: the Wait copies them, nothing runs meanwhile
    add_pending(dst, std::move(p), ctx);
  }

  void prefetch_weight_slices(const std::shared_ptr<const HostBlob>& blob, size_t slice_bytes,
                              std::vector<uint32_t> slices, void* dst,
                              const ExecContext& ctx) override {
    counters().prefetches += 1;
    Pending p;
    p.bytes = blob->size();
    p.blob = blob;
    p.slice_bytes = slice_bytes;
    p.slices = std::move(slices);
    add_pending(dst, std::move(p), ctx);
  }

  void prefetch_input(const void* src, size_t bytes, void* dst,
                      const ExecContext& ctx) override {
    counters().prefetches += 1;
    Pending p;
    p.bytes = bytes;
    p.input = src;  // the caller's, alive for the run: only this run's Wait reads it
    add_pending(dst, std::move(p), ctx);
  }

  void prepare_streamed() override {}  // (the channel is the engine's from the start)

  void prefetch_streamed(const std::shared_ptr<const WeightSource>& w, void* dst,
                         const ExecContext& ctx) override {
    stream(w, {}, 0, {}, dst, ctx);
  }

  void prefetch_streamed_slices(const std::shared_ptr<const WeightSource>& w,
                                size_t slice_bytes, std::vector<uint32_t> slices, void* dst,
                                const ExecContext& ctx) override {
    std::vector<std::pair<uint64_t, uint64_t>> ranges;
    for (uint32_t i : slices) {
      const uint64_t b = w->offset() + static_cast<uint64_t>(i) * slice_bytes;
      ranges.emplace_back(b, b + slice_bytes);
    }
    stream(w, ranges, slice_bytes, std::move(slices), dst, ctx);
  }

  std::shared_ptr<ExpertCacheBase> expert_cache(const std::string& content,
                                                size_t bytes) override {
    std::shared_ptr<Cache> cache = caches_.get(content, [] {
      return std::make_shared<Cache>(&counters().expert_cache_bytes);
    });
    cache->reserve(bytes);
    return cache;
  }

  void prefetch_cached(const std::shared_ptr<const WeightSource>& w,
                       const std::shared_ptr<ExpertCacheBase>& slot, const std::string& key,
                       void* dst, const ExecContext& ctx, uint64_t group,
                       int64_t order) override {
    auto cache = std::static_pointer_cast<Cache>(slot);  // (made by expert_cache() above)
    if (w->size() == 0 || !cache || cache->capacity() == 0) {
      return prefetch_streamed(w, dst, ctx);
    }
    counters().prefetches += 1;
    Pending p;
    p.bytes = w->size();
    p.disk = cache->find(key);
    if (p.disk) {  // a hit: its Wait copies the cached bytes (waiting if still being read)
      counters().expert_cache_hits += 1;
      counters().bytes_expert_cache_hit += p.bytes;
      if (p.disk->warmed.exchange(false)) counters().warm_hits += 1;
    } else {  // a miss: read as streamed (or read ahead), into a buffer the cache keeps
      counters().expert_cache_misses += 1;
      p.disk = take_ahead(group, order, key);
      if (!p.disk) p.disk = read_streamed(w);
      std::vector<std::shared_ptr<DiskTransfer>> evicted;  // (released after the lock)
      cache->insert(key, p.disk, p.bytes, &evicted, /*evict=*/group == 0);
    }
    p.cache = std::move(cache);
    p.cache_key = key;
    add_pending(dst, std::move(p), ctx);
    read_ahead(group, order);
  }

  void warm_cached(const std::shared_ptr<const WeightSource>& w,
                   const std::shared_ptr<ExpertCacheBase>& slot, const std::string& key) override {
    auto cache = std::static_pointer_cast<Cache>(slot);  // (made by expert_cache() above)
    if (w->size() == 0 || !cache || cache->capacity() < w->size()) return;
    if (cache->find(key)) {
      counters().warm_present += 1;
      return;
    }
    std::shared_ptr<DiskTransfer> t = read_streamed(w);
    t->warmed = true;
    counters().warm_reads += 1;
    counters().bytes_warm_read += w->size();
    std::vector<std::shared_ptr<DiskTransfer>> evicted;  // (released after the lock)
    cache->insert(key, std::move(t), w->size(), &evicted);
  }

  StoreKey store(const void* src, size_t bytes, std::vector<int64_t> shape,
                 ONNXTensorElementDataType type, const ExecContext& ctx) override {
    counters().stores += 1;
    auto rec = std::make_shared<CpuStored>(std::move(shape), bytes, type);
    if (bytes != 0) {
      rec->buffer = pool_->acquire(bytes);
      fault_delay();
      // Synchronous: `src` is ORT's and may be freed as soon as this run fails.
      copy_in_compute(ctx, rec->buffer->data(), src, bytes);
      counters().bytes_stored += bytes;
    }
    StoreKey key;
    key.id = g_next_store_id.fetch_add(1);
    {
      std::lock_guard<std::mutex> lock(rng_mu_);
      key.tag = rng_();
    }
    rec->tag = key.tag;
    Released released;
    records_.put_stored(key.id, std::move(rec), nullptr, &released, ctx.kernel);
    return key;
  }

  void detach(const StoreKey& key, const ExecContext& ctx) override {
    Released released;
    if (!records_.find_stored(key.id, nullptr, Tagged{key.tag}, &released)) {
      fail(ORT_INVALID_ARGUMENT, "token names no pending store of this run (id " +
                                     std::to_string(key.id) + ")");
    }
    counters().waits += 1;  // the store completed inside its Compute
  }

  std::shared_ptr<StoredTensor> take_stored(const StoreKey& key,
                                            const ExecContext& ctx) override {
    Released released;
    std::shared_ptr<CpuStored> rec = records_.take_stored(key.id, nullptr, Tagged{key.tag},
                                                          &released);
    if (!rec) {
      fail(ORT_INVALID_ARGUMENT,
           "token names no stored tensor of this run (id " + std::to_string(key.id) +
               "; already reloaded, forged, from an earlier or failed run, or from another "
               "session)");
    }
    return rec;
  }

  void prefetch_stored(std::shared_ptr<StoredTensor> stored, void* dst,
                       const ExecContext& ctx) override {
    counters().prefetches += 1;
    auto rec = std::static_pointer_cast<CpuStored>(std::move(stored));
    Pending p;
    p.bytes = rec->bytes();
    p.stored = std::move(rec);
    add_pending(dst, std::move(p), ctx);
  }

  void forget_kernel(const void* kernel) noexcept override {
    try {
      Released released;  // (destroyed after the records' lock is let go)
      records_.forget(kernel, &released);
    } catch (...) {  // (out of memory for the list: the records go with the engine)
    }
    drop_dead_groups();
  }

  // The decode-cache groups whose caches are gone (their sessions are): what they read
  // ahead goes with them (it waited for a run of a session that no longer exists).
  void drop_dead_groups() noexcept {
    std::vector<Group> dead;  // (released after the lock)
    std::lock_guard<std::mutex> lock(groups_mu_);
    for (auto it = groups_.begin(); it != groups_.end();) {
      if (it->second.dead()) {
        try {
          dead.push_back(std::move(it->second));
        } catch (...) {  // (no room to move it out: released under the lock)
        }
        it = groups_.erase(it);
      } else {
        ++it;
      }
    }
  }

  uint64_t enter_run(const void* kernel, bool per_iteration) override {
    Released released;  // (an earlier run's records: destroyed after the lock is let go)
    return records_.enter(kernel, &released, per_iteration).epoch;
  }

  void join_cache_group(uint64_t group, const std::shared_ptr<ExpertCacheBase>& slot,
                        int64_t order, const std::shared_ptr<const WeightSource>& src,
                        const std::string& key) override {
    if (group == 0 || !slot) return;
    auto cache = std::static_pointer_cast<Cache>(slot);  // (made by expert_cache())
    std::lock_guard<std::mutex> lock(groups_mu_);  // (dead groups go: forget_kernel)
    Group& g = groups_[group];
    g.caches.erase(std::remove_if(g.caches.begin(), g.caches.end(),
                                  [&](const std::weak_ptr<Cache>& m) {
                                    auto held = m.lock();
                                    return !held || held == cache;
                                  }),
                   g.caches.end());
    g.caches.push_back(cache);
    if (order < 0 || !src || src->size() == 0) return;
    auto& same = g.members[order];  // (one per session of the model: the first alive reads)
    same.erase(std::remove_if(same.begin(), same.end(),
                              [](const Member& m) { return m.src.expired(); }),
               same.end());
    same.push_back(Member{src, cache, key, src->size()});
  }

  void limit_cache_group(uint64_t group, size_t kept, size_t ahead) override {
    std::vector<std::shared_ptr<Cache>> caches;
    std::vector<std::shared_ptr<DiskTransfer>> dropped;  // (released after every lock)
    {
      std::lock_guard<std::mutex> lock(groups_mu_);
      auto it = groups_.find(group);
      if (it == groups_.end()) return;
      Group& g = it->second;
      for (const auto& m : g.caches) {
        if (auto c = m.lock()) caches.push_back(std::move(c));
      }
      g.ahead_limit = ahead;
      if (g.ahead_held > ahead) {  // (a run that leaves less room: what was read ahead goes)
        for (auto& kv : g.ahead) dropped.push_back(std::move(kv.second.transfer));
        g.ahead.clear();
        g.ahead_held = 0;
      }
    }
    for (const auto& c : caches) c->set_limit(kept, &dropped);
  }

  void wait(const void* dst, void* out, size_t bytes, const ExecContext& ctx) override {
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
    if (p.bytes != bytes) {
      fail(ORT_FAIL, "input holds " + std::to_string(bytes) + " bytes but its Prefetch loads " +
                         std::to_string(p.bytes));
    }
    const auto t0 = std::chrono::steady_clock::now();
    const char* src = nullptr;
    if (p.blob) src = static_cast<const char*>(p.blob->data());
    if (p.input) src = static_cast<const char*>(p.input);
    if (p.stored && p.stored->buffer) src = static_cast<const char*>(p.stored->buffer->data());
    std::string error;
    if (p.disk) {
      error = p.disk->wait();
      src = p.disk->data();
      if (!error.empty() && p.cache) {  // never served again
        std::vector<std::shared_ptr<DiskTransfer>> evicted;
        p.cache->erase(p.cache_key, p.disk.get(), &evicted);
      }
    }
    counters().waits += 1;
    counters().wait_ns += static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
            .count());
    if (!error.empty()) fail(ORT_FAIL, "transfer failed: " + error);
    // skip_wait (tests): the consumers see what the Prefetch left (poison, if set).
    if (faults::skip_wait()) return;
    if (bytes != 0 && p.slice_bytes != 0) {  // routed: the selected experts' slices only
      for (uint32_t i : p.slices) {
        const size_t off = static_cast<size_t>(i) * p.slice_bytes;
        copy_in_compute(ctx, static_cast<char*>(out) + off, src + off, p.slice_bytes);
      }
      counters().bytes_loaded += p.slices.size() * p.slice_bytes;
    } else if (bytes != 0) {
      copy_in_compute(ctx, out, src, bytes);
      counters().bytes_loaded += bytes;
    }
  }

 private:
  static constexpr size_t kStagingAlign = 4096;

  // Reads `ranges` (absolute [begin, end) within `w`'s range; none: all of it) of `w` on the
  // disk channel into a staging buffer of the engine laid out like the weight, in chunks
  // (FIFO on the I/O threads). `w` is not empty.
  std::shared_ptr<DiskTransfer> read_streamed(
      const std::shared_ptr<const WeightSource>& w,
      std::vector<std::pair<uint64_t, uint64_t>> ranges = {}) {
    const size_t bytes = w->size();
    if (ranges.empty()) ranges.emplace_back(w->offset(), w->offset() + bytes);
    // The staging buffer starts `pad` bytes into a 4096-aligned block so that file offsets
    // aligned for O_DIRECT land on aligned addresses (the whole read can bypass the cache).
    const size_t pad = static_cast<size_t>(w->offset() % kStagingAlign);
    uint64_t total = 0;
    for (const auto& r : ranges) total += r.second - r.first;
    const uint64_t chunk = disk_chunk_for(total, disk_io_threads());
    size_t parts = 0;
    for (const auto& r : ranges) parts += Chunks{r.first, r.second, chunk}.count();
    auto t = std::make_shared<DiskTransfer>(staging_->acquire(bytes + pad), pad, parts);
    char* out = t->data();
    bool first = true;
    for (const auto& r : ranges) {
      const Chunks c{r.first, r.second, chunk};
      for (uint64_t pos = c.begin, q = 0; pos < c.end; pos = q, first = false) {
        q = c.after(pos);
        disk_->submit(
            [t, w, pos, q, to = out + (pos - w->offset()), first] {
              if (first) fault_delay();
              std::string error;
              if (!t->failed()) {
                try {
                  w->read(pos, static_cast<size_t>(q - pos), to);
                } catch (const std::exception& e) {
                  error = std::string("disk channel: ") + e.what();
                }
              }
              t->part_done(std::move(error));
            },
            nullptr);
      }
    }
    return t;
  }

  // A streamed load of `ranges` of `w` (read_streamed); `slices` (of slice_bytes each): what
  // the Wait copies out (none: all of it).
  void stream(const std::shared_ptr<const WeightSource>& w,
              std::vector<std::pair<uint64_t, uint64_t>> ranges, size_t slice_bytes,
              std::vector<uint32_t> slices, void* dst, const ExecContext& ctx) {
    counters().prefetches += 1;
    Pending p;
    p.bytes = w->size();
    p.slice_bytes = slice_bytes;
    p.slices = std::move(slices);
    if (p.bytes != 0) p.disk = read_streamed(w, std::move(ranges));
    add_pending(dst, std::move(p), ctx);
  }

  // (the op entered its run at the start of its Compute: Engine::enter_run)
  void add_pending(void* dst, Pending p, const ExecContext& ctx) {
    if (p.bytes != 0 && faults::poison()) {
      std::memset(dst, 0xFF, p.bytes);  // ORT's buffer, inside this Compute: allowed
    }
    if (p.bytes == 0) return;  // nothing to wait for (the Wait returns at once)
    Released released;  // (a load of a failed run at the same address is dropped)
    records_.put_load(dst, std::move(p), nullptr, &released, ctx.kernel);
  }


  HostStore host_store_;
  std::shared_ptr<HostPool> pool_;     // stored activations (bounded)
  std::shared_ptr<HostPool> staging_;  // disk-tier staging (what is in flight, and cached)
  // Streamed expert loads kept across runs, one cache per data file's content (entries:
  // finished or running reads), held by the kernels that read through it.
  using Cache = ExpertCache<DiskTransfer>;
  WeakCache<Cache> caches_;

  // The decode cache's groups (join_cache_group): a plan's caches, limited by its Guards,
  // and its Prefetches by their place in its reads, whose reads each Prefetch starts ahead
  // of them (read_ahead) within the run's limit; what was read ahead waits in `ahead`
  // (across runs too: the last Prefetches of a step read the next step's first weights)
  // until its Prefetch takes it or a Guard with less room drops it.
  struct Member {
    std::weak_ptr<const WeightSource> src;
    std::weak_ptr<Cache> cache;
    std::string key;
    size_t bytes;
  };
  struct Ahead {
    std::shared_ptr<DiskTransfer> transfer;
    size_t bytes;
    std::string key;  // (the weight it was read for: its file's content, offset, size)
  };
  struct Group {
    std::vector<std::weak_ptr<Cache>> caches;
    std::map<int64_t, std::vector<Member>> members;
    size_t ahead_limit = 0;
    size_t ahead_held = 0;
    std::map<int64_t, Ahead> ahead;
    bool dead() const {
      return std::all_of(caches.begin(), caches.end(),
                         [](const std::weak_ptr<Cache>& m) { return m.expired(); });
    }
  };
  std::mutex groups_mu_;  // guards groups_
  std::unordered_map<uint64_t, Group> groups_;

  // The bytes of the Prefetch at `order` of `group` if an earlier Prefetch read them ahead
  // for its weight (`key`). Another weight at that place (another session of a plan with
  // the same group: a model re-optimized in place over other bytes; or a hostile model's
  // repeated cache_order) never gets them: they may be other bytes, or fewer.
  std::shared_ptr<DiskTransfer> take_ahead(uint64_t group, int64_t order,
                                           const std::string& key) {
    if (group == 0 || order < 0) return nullptr;
    std::lock_guard<std::mutex> lock(groups_mu_);
    auto it = groups_.find(group);
    if (it == groups_.end()) return nullptr;
    Group& g = it->second;
    auto a = g.ahead.find(order);
    if (a == g.ahead.end()) return nullptr;
    std::shared_ptr<DiskTransfer> t = std::move(a->second.transfer);
    const bool mine = a->second.key == key;
    g.ahead_held -= a->second.bytes;
    g.ahead.erase(a);
    if (!mine || t->failed()) return nullptr;  // (read again; a failed read too)
    counters().read_ahead_used += 1;
    return t;
  }

  // Start the reads of the Prefetches after `order` in `group` (wrapping around to the
  // group's first: the next run's), in order, skipping what a cache keeps and what was read
  // ahead already, until the next one does not fit the run's read-ahead limit.
  void read_ahead(uint64_t group, int64_t order) {
    if (group == 0 || order < 0) return;
    std::lock_guard<std::mutex> lock(groups_mu_);
    auto it = groups_.find(group);
    if (it == groups_.end() || it->second.ahead_held >= it->second.ahead_limit) return;
    Group& g = it->second;
    auto m = g.members.upper_bound(order);
    for (size_t i = 0; i < g.members.size(); ++i, ++m) {
      if (m == g.members.end()) m = g.members.begin();
      if (m->first == order) break;  // (round: back at the caller)
      if (g.ahead.count(m->first) != 0) continue;
      const Member* live = nullptr;
      std::shared_ptr<const WeightSource> src;
      for (const Member& c : m->second) {
        if ((src = c.src.lock())) {
          live = &c;
          break;
        }
      }
      if (live == nullptr) continue;
      auto cache = live->cache.lock();
      if (cache && cache->contains(live->key)) continue;  // kept: nothing to read
      if (g.ahead_held + live->bytes > g.ahead_limit) break;
      g.ahead[m->first] = Ahead{read_streamed(src), live->bytes, live->key};
      g.ahead_held += live->bytes;
      counters().read_aheads += 1;
      counters().bytes_read_ahead += live->bytes;
    }
  }
  std::mutex rng_mu_;  // guards rng_
  std::mt19937_64 rng_;
  // (a run's start bounds what the pools keep idle: HostPool::run_started)
  Records records_{process_threads(), [this] {
                     pool_->run_started();
                     staging_->run_started();
                   }};
  std::unique_ptr<Channel> disk_ = std::make_unique<Channel>("disk", disk_io_threads());
};

}  // namespace

void copy_in_compute(const ExecContext& ctx, void* dst, const void* src, size_t n) {
  constexpr size_t kMin = size_t{2} << 20;  // below this, one memcpy
  constexpr size_t kChunk = size_t{1} << 20;
  static const bool parallel = [] {
    const char* v = std::getenv("HO_ONNX_PARALLEL_COPY");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  if (!parallel || n < kMin || ctx.api == nullptr || ctx.kctx == nullptr) {
    std::memcpy(dst, src, n);
    return;
  }
  CopyJob j{static_cast<char*>(dst), static_cast<const char*>(src), n, kChunk};
  const size_t total = (n + kChunk - 1) / kChunk;
  OrtStatus* st = ctx.api->KernelContext_ParallelFor(ctx.kctx, copy_chunk, total, 0, &j);
  if (st != nullptr) {  // no thread pool here: copy on this thread
    ctx.api->ReleaseStatus(st);
    std::memcpy(dst, src, n);
  }
}

std::shared_ptr<Engine> make_cpu_engine(const EngineLimits& limits) {
  return std::make_shared<CpuEngine>(limits);
}

}  // namespace ho
