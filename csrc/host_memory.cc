#include "host_memory.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <iterator>
#include <new>
#include <utility>

#include "common.h"
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


}  // namespace

HostBytes::HostBytes(size_t size, size_t align) : size_(size), align_(align) {
  if (size_ != 0) data_ = ::operator new(size_, std::align_val_t(align_));
}

HostBytes::~HostBytes() {
  if (data_ != nullptr) ::operator delete(data_, std::align_val_t(align_));
}

std::shared_ptr<const HostBlob> HostStore::load(const WeightFile& file,
                                                const std::string& content, int64_t offset,
                                                int64_t length) {
  if (offset < 0 || length < 0) fail(ORT_INVALID_ARGUMENT, "negative offset or length");
  const std::string key =
      content + "\n" + std::to_string(offset) + "\n" + std::to_string(length);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = blobs_.find(key);
  if (it != blobs_.end()) {
    if (std::shared_ptr<const HostBlob> held = it->second.lock()) return held;
  }
  // Entries whose bytes no session holds any more are dropped: amortized, once the map has
  // doubled since the last sweep (a model's session creation loads each weight once).
  if (blobs_.size() >= 2 * swept_size_ + 64) {
    for (auto e = blobs_.begin(); e != blobs_.end();) {
      e = e->second.expired() ? blobs_.erase(e) : std::next(e);
    }
    swept_size_ = blobs_.size();
  }

  auto blob = std::make_shared<FileBlob>(static_cast<size_t>(length));
  pread_exact(file.fd(), static_cast<char*>(blob->mutable_data()), static_cast<size_t>(length),
              static_cast<uint64_t>(offset), file.path());
  blobs_[key] = blob;  // (replaces an expired entry)
  return blob;
}

PoolBuffer::PoolBuffer(std::shared_ptr<HostPool> pool, std::unique_ptr<HostBytes> bytes)
    : pool_(std::move(pool)), bytes_(std::move(bytes)) {
  if (pool_->counted_) counters().host_pool_bytes_in_use += static_cast<int64_t>(bytes_->size());
}

PoolBuffer::~PoolBuffer() {
  if (pool_->counted_) counters().host_pool_bytes_in_use -= static_cast<int64_t>(bytes_->size());
  pool_->release(std::move(bytes_));
}

HostPool::HostPool(uint64_t limit, std::string limit_name, size_t align, bool counted)
    : limit_(limit), limit_name_(std::move(limit_name)), align_(align), counted_(counted) {}

HostPool::~HostPool() {
  if (!counted_) return;
  for (auto& kv : free_) {
    counters().host_pool_bytes_reserved -= static_cast<int64_t>(kv.first);
  }
}

uint64_t HostPool::in_use() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_use_;
}

std::unique_ptr<PoolBuffer> HostPool::acquire(size_t size) {
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
                         "same thread starts)");
    }
    auto it = free_.find(size);
    if (it != free_.end()) {
      bytes = std::move(it->second);
      free_.erase(it);
      free_bytes_ -= size;
    } else {
      // Make room: cached buffers of other sizes go first.
      while (limit_ != 0 && !free_.empty() && in_use_ + free_bytes_ + size > limit_) {
        auto victim = free_.begin();
        free_bytes_ -= victim->first;
        if (counted_) counters().host_pool_bytes_reserved -= static_cast<int64_t>(victim->first);
        dropped.push_back(std::move(victim->second));
        free_.erase(victim);
      }
    }
    in_use_ += size;
  }
  if (!bytes) {
    try {
      bytes = std::make_unique<HostBytes>(size, align_);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      in_use_ -= size;
      throw;
    }
    if (counted_) counters().host_pool_bytes_reserved += static_cast<int64_t>(size);
  }
  return std::make_unique<PoolBuffer>(shared_from_this(), std::move(bytes));
}

void HostPool::release(std::unique_ptr<HostBytes> bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t size = bytes->size();
  in_use_ -= size;
  free_bytes_ += size;
  free_.emplace(size, std::move(bytes));
}

}  // namespace ho
