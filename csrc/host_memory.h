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

// 64-byte aligned host allocation.
class HostBytes {
 public:
  explicit HostBytes(size_t size);
  ~HostBytes();
  HostBytes(const HostBytes&) = delete;
  HostBytes& operator=(const HostBytes&) = delete;
  void* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
};

// Weights: (realpath, offset, length) -> bytes, read once.
class HostStore {
 public:
  std::shared_ptr<const HostBlob> load(const std::string& realpath, int64_t offset,
                                       int64_t length);

 private:
  std::mutex mu_;
  std::map<std::string, std::shared_ptr<const HostBlob>> blobs_;
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

// Stored activations: buffers are reused for later requests of the same size.
class HostPool : public std::enable_shared_from_this<HostPool> {
 public:
  ~HostPool();
  std::unique_ptr<PoolBuffer> acquire(size_t size);

 private:
  friend class PoolBuffer;
  void release(std::unique_ptr<HostBytes> bytes);

  std::mutex mu_;
  std::multimap<size_t, std::unique_ptr<HostBytes>> free_;
};

}  // namespace ho
