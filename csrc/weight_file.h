// Weight locations: a data file resolved only inside the session's model folder, opened once
// (symlink-safe, relative to the folder's descriptor) and validated on the open descriptor.
//
// resolve_weight_file() never looks a name up twice: the folder is opened once, every
// component of the relative location is opened with openat(..., O_NOFOLLOW) relative to the
// previous one, and everything after that (size check, fingerprint, reads, the O_DIRECT
// descriptor through /proc/self/fd) uses the descriptor, so a symlink or file swapped in
// after the check is never read.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>

namespace ho {

class WeightFile {
 public:
  WeightFile(int fd, std::string display, uint64_t size, dev_t dev, ino_t ino,
             std::string model_dir = {}, std::string location = {});
  ~WeightFile();
  WeightFile(const WeightFile&) = delete;
  WeightFile& operator=(const WeightFile&) = delete;

  int fd() const { return fd_; }
  const std::string& path() const { return display_; }  // for messages only, never reopened
  uint64_t size() const { return size_; }                // at open time
  // Identity of the file (device + inode): the key of the engines' caches.
  std::string key() const;
  dev_t dev() const { return dev_; }
  ino_t ino() const { return ino_; }
  // Where it was resolved: the model folder and the normalized relative location, so that
  // the disk tier can open it again by the same rules (resolve_weight_file) and check that
  // it is still the same file (dev(), ino()).
  const std::string& model_dir() const { return model_dir_; }
  const std::string& location() const { return location_; }

 private:
  int fd_;
  std::string display_;
  uint64_t size_;
  dev_t dev_;
  ino_t ino_;
  std::string model_dir_;
  std::string location_;
};

// Opens `location` (relative, no "..", no absolute path) inside `model_dir`. Throws ho::Error
// with a message naming the file.
std::shared_ptr<WeightFile> resolve_weight_file(const std::string& model_dir,
                                                const std::string& location);

// The data-file fingerprint ("fnv1a64s16:" + 16 hex digits): FNV-1a 64 over the file size
// (8 bytes, little-endian) followed by, for each sampled offset o in ascending order without
// duplicates, o (8 bytes, little-endian) and the min(4096, size - o) bytes at o. The sampled
// offsets are (size * k) / 16 for k = 0..15 (integer division) and max(0, size - 4096).
// Reads at most 17 blocks of 4 KiB: cheap at session creation and at optimize time.
std::string data_fingerprint(int fd, uint64_t size);

// pread until `n` bytes are read into `out`; throws naming `path` on error or end of file.
void pread_exact(int fd, char* out, size_t n, uint64_t offset, const std::string& path);

}  // namespace ho
