#include "host_memory.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>
#include <utility>

#include "common.h"

namespace ho {

namespace {
constexpr size_t kAlign = 64;

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

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};
}  // namespace

HostBytes::HostBytes(size_t size) : size_(size) {
  if (size_ != 0) data_ = ::operator new(size_, std::align_val_t(kAlign));
}

HostBytes::~HostBytes() {
  if (data_ != nullptr) ::operator delete(data_, std::align_val_t(kAlign));
}

std::shared_ptr<const HostBlob> HostStore::load(const std::string& realpath, int64_t offset,
                                                int64_t length) {
  const std::string key =
      realpath + "\n" + std::to_string(offset) + "\n" + std::to_string(length);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = blobs_.find(key);
  if (it != blobs_.end()) return it->second;

  auto blob = std::make_shared<FileBlob>(static_cast<size_t>(length));
  Fd fd(::open(realpath.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    fail(ORT_NO_SUCHFILE, "cannot open '" + realpath + "': " + std::strerror(errno));
  }
  auto* out = static_cast<char*>(blob->mutable_data());
  size_t done = 0;
  const auto total = static_cast<size_t>(length);
  while (done < total) {
    const ssize_t n = ::pread(fd.get(), out + done, total - done,
                              static_cast<off_t>(offset) + static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail(ORT_FAIL, "cannot read '" + realpath + "': " + std::strerror(errno));
    if (n == 0) fail(ORT_INVALID_ARGUMENT, "unexpected end of file in '" + realpath + "'");
    done += static_cast<size_t>(n);
  }
  blobs_.emplace(key, blob);
  return blob;
}

PoolBuffer::PoolBuffer(std::shared_ptr<HostPool> pool, std::unique_ptr<HostBytes> bytes)
    : pool_(std::move(pool)), bytes_(std::move(bytes)) {
  counters().host_pool_bytes_in_use += static_cast<int64_t>(bytes_->size());
}

PoolBuffer::~PoolBuffer() {
  counters().host_pool_bytes_in_use -= static_cast<int64_t>(bytes_->size());
  pool_->release(std::move(bytes_));
}

HostPool::~HostPool() {
  for (auto& kv : free_) {
    counters().host_pool_bytes_reserved -= static_cast<int64_t>(kv.first);
  }
}

std::unique_ptr<PoolBuffer> HostPool::acquire(size_t size) {
  std::unique_ptr<HostBytes> bytes;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = free_.find(size);
    if (it != free_.end()) {
      bytes = std::move(it->second);
      free_.erase(it);
    }
  }
  if (!bytes) {
    bytes = std::make_unique<HostBytes>(size);
    counters().host_pool_bytes_reserved += static_cast<int64_t>(size);
  }
  return std::make_unique<PoolBuffer>(shared_from_this(), std::move(bytes));
}

void HostPool::release(std::unique_ptr<HostBytes> bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t size = bytes->size();
  free_.emplace(size, std::move(bytes));
}

}  // namespace ho
