// Host memory of the slow tier: a store of weight bytes read from their tier, and a size-keyed
// pool of buffers for stored activations. Both keep the process-wide counters up to date.
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine.h"
#include "pool_class.h"
#include "weak_cache.h"

namespace ho {

// Aligned host allocation (64 bytes unless asked otherwise). From kMappedBytes on (and an
// alignment within a page) the bytes are an anonymous mapping of their own, unmapped when
// freed: they go back to the system at once, whatever the C library's allocator keeps (its
// heap keeps freed blocks under its moving mmap threshold, up to 32 MiB each).
class HostBytes {
 public:
  explicit HostBytes(size_t size, size_t align = 64);
  ~HostBytes();
  HostBytes(const HostBytes&) = delete;
  HostBytes& operator=(const HostBytes&) = delete;
  void* data() const { return data_; }
  size_t size() const { return size_; }

  static constexpr size_t kMappedBytes = size_t{1} << 20;

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
  size_t align_ = 64;
  bool mapped_ = false;
};

class WeightSource;

// Weights: (content key, offset, length) -> bytes, read once from their source (tiers.h)
// while some caller holds them. Entries are weak: the bytes go with the last session that uses
// them (a model re-optimized in place and hot-swapped keeps one version's weights, not
// every version's), and the content key (Registration::content_key) keeps a new version of
// a file, or a reused inode, from being served an earlier version's bytes.
//
// A range inside one already read and still held is served from it, not read again: the
// row blocks of a tied embedding table's lm_head (rewrite/blocks.py) are ranges of the
// table its GatherRows holds.
class HostStore {
 public:
  std::shared_ptr<const HostBlob> load(const WeightSource& src, const std::string& content);

 private:
  // The ranges read from one content's source: offset -> (length, bytes), and the longest.
  struct Ranges {
    std::multimap<uint64_t, std::pair<size_t, std::weak_ptr<const HostBlob>>> by_offset;
    size_t longest = 0;
  };
  std::shared_ptr<const HostBlob> inside_held(const std::string& content, uint64_t offset,
                                              size_t length);
  void remember(const std::string& content, uint64_t offset, size_t length,
                const std::shared_ptr<const HostBlob>& blob);
  void sweep();  // (under mu_)

  WeakCache<const HostBlob> blobs_;
  std::mutex mu_;                       // guards what follows
  std::map<std::string, Ranges> read_;  // content -> the ranges read (what blobs_ holds)
  size_t ranges_ = 0;                   // ranges in read_ (counted since the last sweep)
  size_t swept_ = 0;                    // ranges after the last sweep
};

class HostPool;

// A buffer taken from the pool (at least the bytes asked for: its size class); goes back
// to it when destroyed.
class PoolBuffer {
 public:
  PoolBuffer(std::shared_ptr<HostPool> pool, std::unique_ptr<HostBytes> bytes, size_t asked);
  ~PoolBuffer();
  PoolBuffer(const PoolBuffer&) = delete;
  PoolBuffer& operator=(const PoolBuffer&) = delete;
  void* data() const { return bytes_->data(); }
  size_t size() const { return asked_; }

 private:
  std::shared_ptr<HostPool> pool_;
  std::unique_ptr<HostBytes> bytes_;
  size_t asked_;
};

// Stored activations (and the disk tier's staging). Requests are rounded up to a size class
// (at most 1/8 more; pool_size_class) so that runs of nearby lengths reuse each other's
// buffers. `limit` (0: none) bounds the bytes in use plus the free buffers kept; acquire()
// throws an ho::Error naming `limit_name` when a request does not fit. The free buffers kept
// idle are bounded by what recent runs needed: at most the most bytes taken between two run
// starts (run_started(), told by the engine), or held at once (concurrent runs), among the
// last kRunWindows windows or the current one; past that the least recently returned go. A
// run that repeats finds every buffer it needs, alone or beside others; runs of changing
// lengths keep about one run's worth (before: a buffer of every
// size ever served stayed, 662 MiB idle after runs of 512 lengths that stored 17 MiB each).
class HostPool : public std::enable_shared_from_this<HostPool> {
 public:
  // `keep_idle` false: a buffer given back is freed at once (the disk tier's staging, whose
  // bytes the plan counts only while a read is in flight).
  HostPool(uint64_t limit, std::string limit_name, size_t align = 64, bool counted = true,
           bool keep_idle = true);
  ~HostPool();
  std::unique_ptr<PoolBuffer> acquire(size_t size);
  uint64_t in_use() const;
  uint64_t idle() const;
  // A run started (on some thread): closes the current window of bytes taken.
  void run_started();
  static constexpr size_t kRunWindows = 256;

 private:
  friend class PoolBuffer;
  struct Free {
    size_t size;
    std::unique_ptr<HostBytes> bytes;
  };
  using FreeList = std::list<Free>;
  void release(std::unique_ptr<HostBytes> bytes);
  // Frees the least recently returned buffers until at most `keep` bytes are idle; what is
  // freed goes to `out` (destroyed outside the lock).
  void trim_locked(uint64_t keep, std::vector<std::unique_ptr<HostBytes>>* out);

  const uint64_t limit_;
  const std::string limit_name_;
  const bool keep_idle_;
  const size_t align_;
  const bool counted_;  // reported in the host_pool_* counters
  mutable std::mutex mu_;
  uint64_t in_use_ = 0;      // class bytes of the buffers taken
  uint64_t free_bytes_ = 0;  // class bytes of the free buffers kept
  uint64_t taken_now_ = 0;   // class bytes taken since the last run_started()
  uint64_t peak_now_ = 0;    // the most in use at once since then
  uint64_t taken_[kRunWindows] = {};  // max(taken, peak) of earlier windows (a ring)
  size_t window_ = 0;        // next slot of taken_
  uint64_t taken_max_ = 0;   // the largest of taken_ (kept at each run start, not per release)
  FreeList lru_;             // free buffers, least recently returned first
  std::multimap<size_t, FreeList::iterator> free_;  // the same, by size class
};

}  // namespace ho
