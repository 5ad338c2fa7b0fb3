// The disk tier: positional reads of weight bytes from their external-data file, with the
// page cache bypassed (O_DIRECT) where the file system allows it.
//
// A DiskFile is one open data file (two descriptors: O_DIRECT when the file system accepts
// it, and a buffered one for the fallback). read() reads a file range into memory the caller
// owns: the block-aligned part goes straight into the destination when the destination's
// address is aligned too, everything else through a per-thread aligned bounce buffer; the
// buffered descriptor is used when O_DIRECT is refused (at open, or EINVAL on a read) or
// disabled with HO_ONNX_DISK_DIRECT=0. Every failure throws an ho::Error naming the file and
// the errno text; a file that became shorter than the range is an error, never short data.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

namespace ho {

// Size of one disk read job (a transfer is split into chunks that the I/O threads serve in
// FIFO order); also the size of each I/O thread's bounce buffer. HO_ONNX_DISK_CHUNK_KB.
size_t disk_chunk_bytes();
// Number of I/O threads of a CPU engine's disk channel. HO_ONNX_IO_THREADS (1..16, default 2).
int disk_io_threads();

class WeightFile;

class DiskFile {
 public:
  // Takes a descriptor of the open, validated data file `file` (never reopened by name; the
  // O_DIRECT descriptor is opened through /proc/self/fd, i.e. the same open file). Throws.
  static std::shared_ptr<DiskFile> open(const WeightFile& file);
  ~DiskFile();
  DiskFile(const DiskFile&) = delete;
  DiskFile& operator=(const DiskFile&) = delete;

  const std::string& path() const { return path_; }
  uint64_t size_now() const;  // fstat; throws
  bool direct() const { return direct_ok_.load(std::memory_order_relaxed); }

  // Read bytes [off, off + n) of the file into `out`. `write_guard` is called around every
  // write into `out` (a pread into it or a copy from the bounce buffer); when it returns
  // false (the transfer was cancelled) nothing more is written and read() returns false.
  // `who` prefixes error messages (the weight's name).
  using Guard = std::function<bool(bool begin)>;
  bool read(uint64_t off, size_t n, char* out, const Guard& write_guard,
            const std::string& who);

 private:
  explicit DiskFile(std::string path) : path_(std::move(path)) {}
  // pread until `n` bytes or end of file; returns the count. Throws on errors but EINVAL
  // from the O_DIRECT descriptor, which returns -1 (caller falls back to buffered).
  int64_t pread_full(int fd, char* buf, size_t n, uint64_t off, bool is_direct,
                     const std::string& who);
  [[noreturn]] void short_read(uint64_t off, size_t n, int64_t got, const std::string& who);
  bool read_buffered(uint64_t off, size_t n, char* out, const Guard& guard,
                     const std::string& who);

  std::string path_;
  int fd_ = -1;         // buffered
  int fd_direct_ = -1;  // O_DIRECT, -1 when refused or disabled
  std::atomic<bool> direct_ok_{false};
  size_t off_align_ = 4096;  // file offset / length alignment of direct I/O
  size_t mem_align_ = 4096;  // memory alignment of direct I/O
};

// Process-wide "disk busy" clock: disk_read_ns grows while at least one read is in flight,
// so bytes_read_disk / disk_read_ns is the rate achieved while streaming, however many I/O
// threads overlap.
class DiskBusy {
 public:
  DiskBusy();
  ~DiskBusy();
  DiskBusy(const DiskBusy&) = delete;
  DiskBusy& operator=(const DiskBusy&) = delete;
};

// The data files an engine reads, opened once and shared by its disk-tier weights.
class DiskFiles {
 public:
  // The open file `file`, checked to hold bytes [offset, offset + length) now. Shared by
  // file identity (device + inode). Throws ho::Error with the range and size.
  std::shared_ptr<DiskFile> open_range(const WeightFile& file, int64_t offset, int64_t length);

 private:
  std::mutex mu_;
  std::map<std::string, std::weak_ptr<DiskFile>> files_;
};

}  // namespace ho
