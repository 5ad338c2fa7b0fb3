#include "host_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <new>
#include <utility>

#include "common.h"
#include "tiers.h"
#include "weight_file.h"

namespace ho {

namespace {

class FileBlob final : public HostBlob {
 public:
  explicit FileBlob(size_t size) : bytes_(size) {
    counters().host_store_bytes += static_cast<int64_t>(size);
  }
  ~FileBlob() override { counters().host_store_bytes -= static_cast<int64_t>(bytes_.size()); }
  const void* data() const override { return bytes_.data(); }
  size_t size() const override { return bytes_.size(); }
  void* mutable_data() { return bytes_.data(); }

 private:
  HostBytes bytes_;
};

// Bytes of a blob held already (a range inside it): no copy of its own.
class SliceBlob final : public HostBlob {
 public:
  SliceBlob(std::shared_ptr<const HostBlob> whole, size_t offset, size_t size)
      : whole_(std::move(whole)), offset_(offset), size_(size) {}
  const void* data() const override {
    return static_cast<const char*>(whole_->data()) + offset_;
  }
  size_t size() const override { return size_; }

 private:
  std::shared_ptr<const HostBlob> whole_;
  size_t offset_;
  size_t size_;
};

}  // namespace

HostBytes::HostBytes(size_t size, size_t align) : size_(size), align_(align) {
  if (size_ == 0) return;
  if (size_ >= kMappedBytes && align_ <= 4096) {
    void* p = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    data_ = p;
    mapped_ = true;
    return;
  }
  data_ = ::operator new(size_, std::align_val_t(align_));
}

HostBytes::~HostBytes() {
  if (data_ == nullptr) return;
  if (mapped_) {
    ::munmap(data_, size_);
  } else {
    ::operator delete(data_, std::align_val_t(align_));
  }
}

std::shared_ptr<const HostBlob> HostStore::load(const WeightSource& src,
                                                const std::string& content) {
  return blobs_.get(weight_key(src, content), [&]() -> std::shared_ptr<const HostBlob> {
    if (std::shared_ptr<const HostBlob> slice = inside_held(content, src.offset(), src.size())) {
      return slice;
    }
    auto blob = std::make_shared<FileBlob>(src.size());
    if (src.size() != 0) {
      src.read(src.offset(), src.size(), static_cast<char*>(blob->mutable_data()));
    }
    remember(content, src.offset(), src.size(), blob);
    return blob;
  });
}

std::shared_ptr<const HostBlob> HostStore::inside_held(const std::string& content,
                                                       uint64_t offset, size_t length) {
  std::lock_guard<std::mutex> lock(mu_);
  auto c = read_.find(content);
  if (c == read_.end()) return nullptr;
  const Ranges& read = c->second;
  // Ranges starting at or before `offset`, nearest first, while one could still reach it.
  for (auto it = read.by_offset.upper_bound(offset); it != read.by_offset.begin();) {
    --it;
    if (offset - it->first > read.longest) break;
    if (it->first + it->second.first < offset + length) continue;
    if (std::shared_ptr<const HostBlob> whole = it->second.second.lock()) {
      return std::make_shared<SliceBlob>(std::move(whole), static_cast<size_t>(offset - it->first),
                                         length);
    }
  }
  return nullptr;
}

void HostStore::remember(const std::string& content, uint64_t offset, size_t length,
                         const std::shared_ptr<const HostBlob>& blob) {
  std::lock_guard<std::mutex> lock(mu_);
  // Ranges whose bytes no session holds any more are dropped: amortized, once the ranges
  // have doubled since the last sweep (as WeakCache does).
  if (ranges_ >= 2 * swept_ + 64) sweep();
  Ranges& read = read_[content];
  read.by_offset.emplace(offset, std::make_pair(length, std::weak_ptr<const HostBlob>(blob)));
  read.longest = std::max(read.longest, length);
  ++ranges_;
}

void HostStore::sweep() {
  ranges_ = 0;  // (recounted: the survivors)
  for (auto c = read_.begin(); c != read_.end();) {
    auto& ranges = c->second.by_offset;
    for (auto r = ranges.begin(); r != ranges.end();) {
      r = r->second.second.expired() ? ranges.erase(r) : std::next(r);
    }
    ranges_ += ranges.size();
    c = ranges.empty() ? read_.erase(c) : std::next(c);
  }
  swept_ = ranges_;
}

PoolBuffer::PoolBuffer(std::shared_ptr<HostPool> pool, std::unique_ptr<HostBytes> bytes,
                       size_t asked)
    : pool_(std::move(pool)), bytes_(std::move(bytes)), asked_(asked) {
  if (pool_->counted_) counters().host_pool_bytes_in_use += static_cast<int64_t>(asked_);
}

PoolBuffer::~PoolBuffer() {
  if (pool_->counted_) counters().host_pool_bytes_in_use -= static_cast<int64_t>(asked_);
  pool_->release(std::move(bytes_));
}

HostPool::HostPool(uint64_t limit, std::string limit_name, size_t align, bool counted,
                   bool keep_idle)
    : limit_(limit),
      limit_name_(std::move(limit_name)),
      keep_idle_(keep_idle),
      align_(align),
      counted_(counted) {}

HostPool::~HostPool() {
  if (!counted_) return;
  counters().host_pool_bytes_reserved -= static_cast<int64_t>(free_bytes_);
}

uint64_t HostPool::in_use() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_use_;
}

uint64_t HostPool::idle() const {
  std::lock_guard<std::mutex> lock(mu_);
  return free_bytes_;
}

void HostPool::run_started() {
  std::lock_guard<std::mutex> lock(mu_);
  taken_[window_] = std::max(taken_now_, peak_now_);
  window_ = (window_ + 1) % kRunWindows;
  taken_now_ = 0;
  taken_max_ = *std::max_element(std::begin(taken_), std::end(taken_));
  peak_now_ = in_use_;
}

void HostPool::trim_locked(uint64_t keep, std::vector<std::unique_ptr<HostBytes>>* out) {
  while (free_bytes_ > keep && !lru_.empty()) {
    Free& victim = lru_.front();
    auto range = free_.equal_range(victim.size);
    for (auto it = range.first; it != range.second; ++it) {
      if (it->second == lru_.begin()) {
        free_.erase(it);
        break;
      }
    }
    free_bytes_ -= victim.size;
    if (counted_) counters().host_pool_bytes_reserved -= static_cast<int64_t>(victim.size);
    out->push_back(std::move(victim.bytes));
    lru_.pop_front();
  }
}

std::unique_ptr<PoolBuffer> HostPool::acquire(size_t asked) {
  const size_t size = pool_size_class(asked);
  std::unique_ptr<HostBytes> bytes;
  std::vector<std::unique_ptr<HostBytes>> dropped;  // freed outside the lock
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (limit_ != 0 && (size > limit_ || in_use_ > limit_ - size)) {
      fail(ORT_FAIL, "host pool limit exceeded: " + std::to_string(in_use_) +
                         " bytes of stored activations in use + " + std::to_string(size) +
                         " requested > " + std::to_string(limit_) +
                         " bytes (raise the session config entry '" + limit_name_ +
                         "'; a failed run's stores are released when the next run on the "
                         "same thread starts or its session is destroyed)");
    }
    auto it = free_.find(size);
    if (it != free_.end()) {
      FreeList::iterator node = it->second;
      bytes = std::move(node->bytes);
      lru_.erase(node);
      free_.erase(it);
      free_bytes_ -= size;
    } else if (limit_ != 0 && in_use_ + free_bytes_ + size > limit_) {
      // Make room: cached buffers of other sizes go first.
      trim_locked(limit_ - in_use_ - size, &dropped);
    }
    in_use_ += size;
    taken_now_ += size;
    peak_now_ = std::max(peak_now_, in_use_);
  }
  if (!bytes) {
    try {
      bytes = std::make_unique<HostBytes>(size, align_);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      in_use_ -= size;
      throw;
    }
    if (counted_) {
      counters().host_pool_bytes_reserved += static_cast<int64_t>(size);
      counters().host_pool_allocs += 1;
    }
  }
  return std::make_unique<PoolBuffer>(shared_from_this(), std::move(bytes), asked);
}

void HostPool::release(std::unique_ptr<HostBytes> bytes) {
  std::vector<std::unique_ptr<HostBytes>> dropped;  // freed outside the lock
  std::lock_guard<std::mutex> lock(mu_);
  const size_t size = bytes->size();
  in_use_ -= size;
  if (!keep_idle_) {
    dropped.push_back(std::move(bytes));  // (freed outside the lock)
    return;
  }
  lru_.push_back(Free{size, std::move(bytes)});
  free_.emplace(size, std::prev(lru_.end()));
  free_bytes_ += size;
  const uint64_t keep = std::max({taken_now_, peak_now_, taken_max_});
  trim_locked(keep, &dropped);
}

}  // namespace ho
