// The disk tier: positional reads of weight bytes from their external-data file, with the
// page cache bypassed (O_DIRECT) where the file system allows it.
//
// A DiskFile is one validated data file. Its descriptors (two: O_DIRECT when the file system
// accepts it, and a buffered one for the fallback) are not held for the session's life: they
// live in a process-wide, bounded cache of open files (disk_open_files(), least recently used
// closed first), so that a model with hundreds of data files opens under an ordinary
// descriptor limit. A file evicted from the cache is opened again on demand by the rules of
// resolve_weight_file (inside the model folder, nothing below it followed) and must still be
// the file validated at session creation (same device and inode): a file replaced since then
// is an error naming it, never read. read() reads a file range into memory the caller owns:
// the block-aligned part goes straight into the destination when the destination's address
// is aligned too, everything else through a per-thread aligned bounce buffer; the buffered
// descriptor is used when O_DIRECT is refused (at open, or EINVAL on a read) or disabled with
// HO_ONNX_DISK_DIRECT=0. Every failure throws an ho::Error naming the file and the errno
// text; a file that became shorter than the range is an error, never short data.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <sys/types.h>
#include <utility>

#include "weak_cache.h"

namespace ho {

// Largest disk read job (a transfer is split into chunks that the I/O threads serve in FIFO
// order); also the size of each I/O thread's bounce buffer. HO_ONNX_DISK_CHUNK_KB.
size_t disk_chunk_bytes();
// The chunk for a transfer of `bytes` on a channel of `threads` I/O threads: split so that a
// lone read keeps every thread busy (bytes / threads, a multiple of 4096), within
// [min(1 MiB, disk_chunk_bytes()), disk_chunk_bytes()]. At a decode step the few reads the
// cache misses each wait alone; one 8 MiB job per read ran them on one thread. Both engines.
uint64_t disk_chunk_for(uint64_t bytes, int threads);
// Number of I/O threads of an engine's disk channel (both engines). HO_ONNX_IO_THREADS
// (1..16, default 2).
int disk_io_threads();
// Most data files whose descriptors the process keeps open while idle (each holds up to two
// descriptors). HO_ONNX_DISK_OPEN_FILES (1..65536); default: an eighth of the soft
// RLIMIT_NOFILE at first use (so a quarter of it in descriptors), within 4..256.
size_t disk_open_files();
// Descriptor pairs held now by the cache (idle or in use), for tests and counters.
size_t disk_open_files_now();

class WeightFile;

class DiskFile {
 public:
  // The open, validated data file `file` (its descriptor is duplicated into the cache; the
  // O_DIRECT one is opened through /proc/self/fd, i.e. the same open file). Throws.
  static std::shared_ptr<DiskFile> open(const WeightFile& file);
  ~DiskFile();
  DiskFile(const DiskFile&) = delete;
  DiskFile& operator=(const DiskFile&) = delete;

  const std::string& path() const { return path_; }
  bool direct() const { return direct_ok_.load(std::memory_order_relaxed); }

  // Read bytes [off, off + n) of the file into `out`. `write_guard` is called around every
  // write into `out` (a pread into it or a copy from the bounce buffer); when it returns
  // false (the transfer was cancelled) nothing more is written and read() returns false.
  // `who` prefixes error messages (the weight's name).
  using Guard = std::function<bool(bool begin)>;
  bool read(uint64_t off, size_t n, char* out, const Guard& write_guard,
            const std::string& who);

  struct Fds;  // the descriptors of one opening (RAII)

 private:
  DiskFile() = default;
  // The file's descriptors: from the cache, or opened again and re-validated. Throws.
  std::shared_ptr<const Fds> fds(const std::string& who);
  std::shared_ptr<const Fds> reopen(const std::string& who);
  // The descriptors of a validated open file `fd` (duplicated). Throws.
  std::shared_ptr<const Fds> make_fds(int fd, bool first);
  uint64_t size_now(const Fds& f) const;  // fstat; throws
  // pread until `n` bytes or end of file; returns the count. Throws on errors but EINVAL
  // from the O_DIRECT descriptor, which returns -1 (caller falls back to buffered).
  int64_t pread_full(int fd, char* buf, size_t n, uint64_t off, bool is_direct,
                     const std::string& who);
  [[noreturn]] void short_read(const Fds& f, uint64_t off, size_t n, int64_t got,
                               const std::string& who);
  bool read_buffered(const Fds& f, uint64_t off, size_t n, char* out, const Guard& guard,
                     const std::string& who);

  uint64_t id_ = 0;        // key in the open-file cache, unique in the process
  std::string path_;       // for messages
  std::string model_dir_;  // where it is opened again: resolve_weight_file(model_dir_,
  std::string location_;   //   location_), which must give the same (dev_, ino_)
  dev_t dev_ = 0;
  ino_t ino_ = 0;
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

// The data files the disk tier reads, shared by its weights (one per process: tiers.cc).
class DiskFiles {
 public:
  // The validated file `file`, checked to hold bytes [offset, offset + length). Shared by
  // file identity (device + inode) and where it was found (folder and location: that is
  // where it is opened again). Throws ho::Error with the range and size.
  std::shared_ptr<DiskFile> open_range(const WeightFile& file, int64_t offset, int64_t length);

 private:
  WeakCache<DiskFile> files_;
};

}  // namespace ho
