// CPU-EP engine: host store + host pool, two channels (load, store) whose worker threads
// copy with memcpy, and a disk channel whose I/O threads read disk-tier weights from their
// data files (disk_io.h). "Fast tier" buffers are ORT's CPU tensors.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <string>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>

#include "channel.h"
#include "common.h"
#include "disk_io.h"
#include "engine.h"
#include "host_memory.h"

namespace ho {

namespace {

// Store ids are unique in the process, so a token of another engine is never mistaken.
std::atomic<uint64_t> g_next_store_id{1};

void debug_delay() {
  const int64_t us = debug().delay_us.load(std::memory_order_relaxed);
  if (us > 0) std::this_thread::sleep_for(std::chrono::microseconds(us));
}

class CpuStored final : public StoredTensor {
 public:
  CpuStored(std::vector<int64_t> shape, size_t bytes) : shape_(std::move(shape)), bytes_(bytes) {}
  const std::vector<int64_t>& shape() const override { return shape_; }
  size_t bytes() const override { return bytes_; }

  std::unique_ptr<PoolBuffer> buffer;  // null for zero bytes; released after the reload
  CompletionPtr stored = std::make_shared<Completion>();

 private:
  std::vector<int64_t> shape_;
  size_t bytes_;
};

class CpuDiskWeight final : public DiskSource {
 public:
  CpuDiskWeight(std::shared_ptr<DiskFile> file, uint64_t offset, size_t length, std::string name)
      : file(std::move(file)), offset(offset), length(length), who("weight '" + name + "'") {}
  size_t size() const override { return length; }

  const std::shared_ptr<DiskFile> file;
  const uint64_t offset;
  const size_t length;
  const std::string who;  // for messages
};

// One disk transfer split into chunks served by the I/O threads. The load's completion is
// finished when the last chunk job lets go of this record (ran, or dropped with the engine),
// with the first error of any chunk.
class DiskTransfer {
 public:
  DiskTransfer(CompletionPtr done, size_t parts) : done_(std::move(done)), remaining_(parts) {}
  ~DiskTransfer() {
    if (error_.empty() && remaining_ != 0) {
      error_ = "disk channel: transfer cancelled (engine destroyed)";
    }
    done_->finish(std::move(error_));
  }
  DiskTransfer(const DiskTransfer&) = delete;
  DiskTransfer& operator=(const DiskTransfer&) = delete;

  Completion* completion() const { return done_.get(); }
  bool failed() {
    std::lock_guard<std::mutex> lock(mu_);
    return !error_.empty();
  }
  void part_done(std::string error = {}) {
    std::lock_guard<std::mutex> lock(mu_);
    if (error_.empty() && !error.empty()) error_ = std::move(error);
    --remaining_;
  }

 private:
  CompletionPtr done_;
  std::mutex mu_;
  std::string error_;
  size_t remaining_;
};

class CpuEngine final : public Engine {
 public:
  CpuEngine() { counters().engines_alive += 1; }

  ~CpuEngine() override {
    // Loads nobody waited for (a failed run, a graph without its Wait) must not write into
    // ORT's buffers any more: cancel them, then stop the channels (queued jobs are dropped)
    // before the pool buffers and stored records they use go away.
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& kv : pending_) kv.second->cancel();
    }
    load_.reset();
    store_.reset();
    disk_.reset();
    pending_.clear();
    stored_.clear();
    counters().engines_alive -= 1;
  }

  std::shared_ptr<const HostBlob> load_weight(const std::string& realpath, int64_t offset,
                                              int64_t length) override {
    return host_store_.load(realpath, offset, length);
  }

  void prefetch_weight(const std::shared_ptr<const HostBlob>& blob, void* dst,
                       const ExecContext&) override {
    counters().prefetches += 1;
    const size_t bytes = blob->size();
    if (bytes == 0) return;
    CompletionPtr done = begin_load(dst, bytes);
    std::shared_ptr<const HostBlob> src = blob;
    load_->submit(
        [src, dst, bytes, d = done.get()] {
          debug_delay();
          if (!d->begin_write()) return;
          std::memcpy(dst, src->data(), bytes);
          d->end_write();
          counters().bytes_loaded += bytes;
        },
        done);
  }

  std::shared_ptr<const DiskSource> open_disk_weight(const std::string& realpath, int64_t offset,
                                                     int64_t length,
                                                     const std::string& name) override {
    std::shared_ptr<DiskFile> file = files_.open_range(realpath, offset, length);
    return std::make_shared<CpuDiskWeight>(std::move(file), static_cast<uint64_t>(offset),
                                           static_cast<size_t>(length), name);
  }

  void prefetch_disk(const std::shared_ptr<const DiskSource>& src, void* dst,
                     const ExecContext&) override {
    counters().prefetches += 1;
    auto w = std::static_pointer_cast<const CpuDiskWeight>(src);
    const size_t bytes = w->length;
    if (bytes == 0) return;
    CompletionPtr done = begin_load(dst, bytes);
    // Chunks at chunk-aligned file offsets, so only the first and last can be unaligned.
    const uint64_t chunk = disk_chunk_bytes();
    const uint64_t begin = w->offset;
    const uint64_t end = w->offset + bytes;
    const size_t parts = static_cast<size_t>((end - 1) / chunk - begin / chunk + 1);
    auto t = std::make_shared<DiskTransfer>(std::move(done), parts);
    char* out = static_cast<char*>(dst);
    uint64_t p = begin;
    for (size_t i = 0; i < parts; ++i) {
      const uint64_t q = std::min(end, (p / chunk + 1) * chunk);
      disk_->submit(
          [t, w, p, q, dst = out + (p - begin), first = i == 0] {
            if (first) debug_delay();
            std::string error;
            if (!t->failed()) {
              try {
                Completion* d = t->completion();
                const DiskFile::Guard guard = [d](bool start) {
                  if (start) return d->begin_write();
                  d->end_write();
                  return true;
                };
                DiskBusy busy;
                if (w->file->read(p, static_cast<size_t>(q - p), dst, guard, w->who)) {
                  counters().bytes_read_disk += q - p;
                  counters().bytes_loaded += q - p;
                }
              } catch (const std::exception& e) {
                error = std::string("disk channel: ") + e.what();
              }
            }
            t->part_done(std::move(error));
          },
          nullptr);
      p = q;
    }
  }

  uint64_t store(const void* src, size_t bytes, std::vector<int64_t> shape,
                 const ExecContext&) override {
    counters().stores += 1;
    auto rec = std::make_shared<CpuStored>(std::move(shape), bytes);
    const uint64_t id = g_next_store_id.fetch_add(1);
    if (bytes != 0) rec->buffer = pool_->acquire(bytes);
    {
      std::lock_guard<std::mutex> lock(mu_);
      stored_.emplace(id, rec);
    }
    if (bytes == 0) {
      rec->stored->finish();
      return id;
    }
    void* dst = rec->buffer->data();
    store_->submit(
        [src, dst, bytes] {
          debug_delay();
          std::memcpy(dst, src, bytes);
          counters().bytes_stored += bytes;
        },
        rec->stored);
    return id;
  }

  void detach(uint64_t id, const ExecContext&) override {
    std::shared_ptr<CpuStored> rec;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = stored_.find(id);
      if (it == stored_.end()) {
        fail(ORT_INVALID_ARGUMENT, "token names no pending store (id " +
                                       std::to_string(id) + ")");
      }
      rec = it->second;
    }
    if (debug().skip_wait.load(std::memory_order_relaxed)) return;
    const std::string error = timed_wait(*rec->stored);
    if (!error.empty()) fail(ORT_FAIL, "store failed: " + error);
  }

  std::shared_ptr<StoredTensor> take_stored(uint64_t id) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = stored_.find(id);
    if (it == stored_.end()) {
      fail(ORT_INVALID_ARGUMENT,
           "token names no stored tensor (id " + std::to_string(id) +
               "; already reloaded, or from another session)");
    }
    std::shared_ptr<StoredTensor> rec = std::move(it->second);
    stored_.erase(it);
    return rec;
  }

  void prefetch_stored(std::shared_ptr<StoredTensor> stored, void* dst,
                       const ExecContext&) override {
    counters().prefetches += 1;
    auto rec = std::static_pointer_cast<CpuStored>(std::move(stored));
    const size_t bytes = rec->bytes();
    if (bytes == 0) return;
    CompletionPtr done = begin_load(dst, bytes);
    load_->submit(
        [rec, dst, bytes, d = done.get()] {
          const std::string error = rec->stored->wait();
          if (!error.empty()) throw Error(ORT_FAIL, "reload of a failed store: " + error);
          debug_delay();
          if (d->begin_write()) {
            std::memcpy(dst, rec->buffer->data(), bytes);
            d->end_write();
            counters().bytes_loaded += bytes;
          }
          rec->buffer.reset();  // back to the pool
        },
        done);
  }

  void wait(const void* dst, size_t bytes, const ExecContext&) override {
    if (bytes == 0) return;
    CompletionPtr done;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = pending_.find(dst);
      if (it == pending_.end()) {
        fail(ORT_FAIL, "no transfer pending for input (already waited, or not a Prefetch "
                       "output)");
      }
      done = std::move(it->second);
      pending_.erase(it);
    }
    if (debug().skip_wait.load(std::memory_order_relaxed)) {
      done->cancel();  // return at once; the transfer never lands (no late write)
      return;
    }
    const std::string error = timed_wait(*done);
    if (!error.empty()) fail(ORT_FAIL, "transfer failed: " + error);
  }

 private:
  // Register the load into `dst`. A stale one for the same buffer (a run that failed
  // between Prefetch and Wait) is cancelled first so it cannot overwrite the new data.
  CompletionPtr begin_load(void* dst, size_t bytes) {
    auto done = std::make_shared<Completion>();
    CompletionPtr old;
    {
      std::lock_guard<std::mutex> lock(mu_);
      CompletionPtr& slot = pending_[dst];
      old = std::move(slot);
      slot = done;
    }
    if (old) old->cancel();
    if (debug().poison.load(std::memory_order_relaxed)) std::memset(dst, 0xFF, bytes);
    return done;
  }

  static std::string timed_wait(Completion& c) {
    const auto t0 = std::chrono::steady_clock::now();
    std::string error = c.wait();
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::steady_clock::now() - t0)
                        .count();
    counters().waits += 1;
    counters().wait_ns += static_cast<uint64_t>(ns);
    return error;
  }

  HostStore host_store_;
  std::shared_ptr<HostPool> pool_ = std::make_shared<HostPool>();
  std::mutex mu_;
  std::unordered_map<const void*, CompletionPtr> pending_;
  std::unordered_map<uint64_t, std::shared_ptr<CpuStored>> stored_;
  std::unique_ptr<Channel> load_ = std::make_unique<Channel>("load");
  std::unique_ptr<Channel> store_ = std::make_unique<Channel>("store");
  DiskFiles files_;  // open data files, shared by weights
  std::unique_ptr<Channel> disk_ = std::make_unique<Channel>("disk", disk_io_threads());
};

}  // namespace

std::shared_ptr<Engine> make_cpu_engine() { return std::make_shared<CpuEngine>(); }

}  // namespace ho
