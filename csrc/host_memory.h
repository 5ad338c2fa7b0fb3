// Host memory of the slow tier: a store of weight bytes read from files, and a size-keyed
// pool of buffers for stored activations. Both keep the process-wide counters up to date.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine.h"

namespace ho {

// Aligned host allocation (64 bytes unless asked otherwise).
class HostBytes {
 public:
  explicit HostBytes(size_t size, size_t align = 64);
  ~HostBytes();
  HostBytes(const HostBytes&) = delete;
  HostBytes& operator=(const HostBytes&) = delete;
  void* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
  size_t align_ = 64;
};

class WeightFile;

// Weights: (content key, offset, length) -> bytes, read once from the open file while
// some caller holds them. Entries are weak: the bytes go with the last session that uses
// them (a model re-optimized in place and hot-swapped keeps one version's weights, not
// every version's), and the content key (Registration::content_key) keeps a new version of
// a file, or a reused inode, from being served an earlier version's bytes.
class HostStore {
 public:
  std::shared_ptr<const HostBlob> load(const WeightFile& file, const std::string& content,
                                       int64_t offset, int64_t length);

 private:
  std::mutex mu_;
  std::map<std::string, std::weak_ptr<const HostBlob>> blobs_;
  size_t swept_size_ = 0;  // entries after the last sweep of expired ones
};

class HostPool;

// A buffer taken from the pool; goes back to it when destroyed.
class PoolBuffer {
 public:
  PoolBuffer(std::shared_ptr<HostPool> pool, std::unique_ptr<HostBytes> bytes);
  ~PoolBuffer();
  PoolBuffer(const PoolBuffer&) = delete;
  PoolBuffer& operator=(const PoolBuffer&) = delete;
  void* data() const { return bytes_->data(); }
  size_t size() const { return bytes_->size(); }

 private:
  std::shared_ptr<HostPool> pool_;
  std::unique_ptr<HostBytes> bytes_;
};

// Stored activations (and the disk tier's staging): buffers are reused for later requests
// of the same size. `limit` (0: none) bounds the bytes in use plus the free buffers kept;
// acquire() throws an ho::Error naming `limit_name` when a request does not fit.
class HostPool : public std::enable_shared_from_this<HostPool> {
 public:
  HostPool(uint64_t limit, std::string limit_name, size_t align = 64, bool counted = true);
  ~HostPool();
  std::unique_ptr<PoolBuffer> acquire(size_t size);
  uint64_t in_use() const;

 private:
  friend class PoolBuffer;
  void release(std::unique_ptr<HostBytes> bytes);

  const uint64_t limit_;
  const std::string limit_name_;
  const size_t align_;
  const bool counted_;  // reported in the host_pool_* counters
  mutable std::mutex mu_;
  uint64_t in_use_ = 0;
  uint64_t free_bytes_ = 0;
  std::multimap<size_t, std::unique_ptr<HostBytes>> free_;
};

}  // namespace ho
