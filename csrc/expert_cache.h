// The expert cache (issue 37): the bytes of routed expert weights of a streamed tier (disk)
// kept in library memory across runs, least recently used first out, so a hot expert is not
// read from its file again. An engine keeps one per data file (its content key: the sessions
// of one model share it, those of another model, or of a new version of the file, have
// their own), held by the kernels that read through it: it goes with the last of them. Its
// capacity is the largest its kernels' models asked for; it serves concurrent runs.
//
// Policy: LRU by bytes. An entry is touched when a Prefetch asks for it (a hit) or made when
// it misses (the read that fills it starts then), in the order the Prefetches run; entries
// least recently asked for go until the new one fits; an entry larger than the whole
// capacity is never kept. What a reader holds is a std::shared_ptr: an evicted entry's bytes
// stay until its last reader (a Wait copying out of it) lets go, so eviction never frees
// memory under a reader. The capacity counts the entries' payload bytes (their buffers are
// rounded up to the staging pool's size classes).
//
// The decode cache (docs/design.md, "The decode cache") uses the same cache, one per plan
// (not per data file: its keys name each weight's file), for the dense streamed weights a
// range plan keeps across runs where a run's plan leaves room: each run's last Guard sets a
// limit (set_limit: the bytes the plan leaves at that run's dims, which evicts down to it at
// once), and its weights are kept only while they fit (insert with `evict` false: a weight
// that does not fit is read as streamed and not kept, so the weights of a step, read in the
// same order at every step, never evict each other as LRU would).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

namespace ho {

// What the engine seam hands a kernel (engine.h: Engine::expert_cache); the engine that made
// it knows its entries' type.
class ExpertCacheBase {
 public:
  virtual ~ExpertCacheBase() = default;
};

template <typename T>
class ExpertCache final : public ExpertCacheBase {
 public:
  // `gauge` (may be null): a process-wide count of the bytes held, kept up to date.
  explicit ExpertCache(std::atomic<int64_t>* gauge = nullptr) : gauge_(gauge) {}
  ~ExpertCache() override {
    if (gauge_ != nullptr) *gauge_ -= static_cast<int64_t>(held_);
  }
  ExpertCache(const ExpertCache&) = delete;
  ExpertCache& operator=(const ExpertCache&) = delete;

  // Raise the capacity to `bytes` (the largest any of its kernels asked for; it never
  // shrinks while the cache lives).
  void reserve(size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    if (bytes > capacity_) capacity_ = bytes;
  }
  size_t capacity() const {
    std::lock_guard<std::mutex> lock(mu_);
    return capacity_;
  }
  size_t held() const {
    std::lock_guard<std::mutex> lock(mu_);
    return held_;
  }

  // Hold at most `bytes` from now on (the latest run's Guard: concurrent runs share the
  // cache, the latest limit holds), evicting the least recently used entries down to it now.
  template <typename Out>
  void set_limit(size_t bytes, Out* out) {
    std::lock_guard<std::mutex> lock(mu_);
    limit_ = bytes;
    while (held_ > limit_ && !lru_.empty()) drop_locked(map_.find(lru_.front().key), out);
  }

  // Whether an entry is under `key` (its use order unchanged).
  bool contains(const std::string& key) const {
    std::lock_guard<std::mutex> lock(mu_);
    return map_.count(key) != 0;
  }

  // The entry under `key`, made most recently used; null when absent.
  std::shared_ptr<T> find(const std::string& key) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = map_.find(key);
    if (it == map_.end()) return nullptr;
    lru_.splice(lru_.end(), lru_, it->second);
    return it->second->value;
  }

  // Keep `value` (of `bytes` bytes) under `key` as the most recently used entry, evicting the
  // least recently used until it fits (`evict` false: none, it is kept only if it fits as
  // is); false (nothing kept) when it is larger than the capacity or the limit. An entry
  // already under `key` is replaced. The evicted values are handed to `out`, so that they
  // are released outside the lock.
  template <typename Out>
  bool insert(const std::string& key, std::shared_ptr<T> value, size_t bytes, Out* out,
              bool evict = true) {
    std::lock_guard<std::mutex> lock(mu_);
    const size_t room = std::min(capacity_, limit_);
    if (bytes > room) return false;
    auto it = map_.find(key);
    if (it != map_.end()) drop_locked(it, out);
    if (!evict && held_ + bytes > room) return false;
    while (held_ + bytes > room && !lru_.empty()) drop_locked(map_.find(lru_.front().key), out);
    lru_.push_back(Entry{key, std::move(value), bytes});
    map_[key] = std::prev(lru_.end());
    held_ += bytes;
    if (gauge_ != nullptr) *gauge_ += static_cast<int64_t>(bytes);
    return true;
  }

  // Forget `key` if it still holds `value` (a failed read is never served again).
  template <typename Out>
  void erase(const std::string& key, const T* value, Out* out) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = map_.find(key);
    if (it != map_.end() && it->second->value.get() == value) drop_locked(it, out);
  }

 private:
  struct Entry {
    std::string key;
    std::shared_ptr<T> value;
    size_t bytes;
  };
  using List = std::list<Entry>;

  template <typename Out>
  void drop_locked(typename std::map<std::string, typename List::iterator>::iterator it,
                   Out* out) {
    held_ -= it->second->bytes;
    if (gauge_ != nullptr) *gauge_ -= static_cast<int64_t>(it->second->bytes);
    out->push_back(std::move(it->second->value));
    lru_.erase(it->second);
    map_.erase(it);
  }

  std::atomic<int64_t>* const gauge_;
  mutable std::mutex mu_;  // guards what follows
  size_t capacity_ = 0;
  size_t limit_ = SIZE_MAX;  // (set_limit: the latest run's; none until a Guard sets one)
  size_t held_ = 0;
  List lru_;  // least recently used first
  std::map<std::string, typename List::iterator> map_;
};

}  // namespace ho
