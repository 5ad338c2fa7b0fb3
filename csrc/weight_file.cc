#include "weight_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <set>
#include <utility>
#include <vector>

#include "common.h"
#include "fnv1a.h"

namespace ho {

namespace {

class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int release() {
    const int f = fd_;
    fd_ = -1;
    return f;
  }
  void reset(int fd) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_;
};

std::string errno_text(int e) { return std::strerror(e); }

std::string describe_open_error(const std::string& shown, int e) {
  if (e == ENOENT) return "file '" + shown + "' does not exist";
  if (e == ELOOP || e == ENOTDIR) {
    return "cannot open '" + shown + "' (" + errno_text(e) +
           "): symbolic links inside the model directory are not followed";
  }
  return "cannot open '" + shown + "': " + errno_text(e);
}

}  // namespace

WeightFile::WeightFile(int fd, std::string display, uint64_t size, dev_t dev, ino_t ino,
                       std::string model_dir, std::string location)
    : fd_(fd),
      display_(std::move(display)),
      size_(size),
      dev_(dev),
      ino_(ino),
      model_dir_(std::move(model_dir)),
      location_(std::move(location)) {}

WeightFile::~WeightFile() {
  if (fd_ >= 0) ::close(fd_);
}

std::string WeightFile::key() const {
  return std::to_string(static_cast<uint64_t>(dev_)) + ":" +
         std::to_string(static_cast<uint64_t>(ino_));
}

void pread_exact(int fd, char* out, size_t n, uint64_t offset, const std::string& path) {
  size_t done = 0;
  while (done < n) {
    const ssize_t r = ::pread(fd, out + done, n - done, static_cast<off_t>(offset + done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) fail(ORT_FAIL, "cannot read '" + path + "': " + errno_text(errno));
    if (r == 0) fail(ORT_FAIL, "unexpected end of file in '" + path + "'");
    done += static_cast<size_t>(r);
  }
}

namespace {

// The components of a relative location after lexical normalization ("a/../b" is "b"),
// before any lookup: nothing is resolved through the file system, and a location that
// climbs above the folder is refused.
std::vector<std::string> location_parts(const std::string& location) {
  if (location.empty()) fail(ORT_INVALID_ARGUMENT, "empty location");
  if (location.front() == '/') {
    fail(ORT_INVALID_ARGUMENT, "location must be relative to the model folder");
  }
  if (location.find('\0') != std::string::npos) fail(ORT_INVALID_ARGUMENT, "NUL in location");
  std::vector<std::string> parts;
  size_t pos = 0;
  while (pos <= location.size()) {
    size_t end = location.find('/', pos);
    if (end == std::string::npos) end = location.size();
    std::string part = location.substr(pos, end - pos);
    if (part == "..") {
      if (parts.empty()) fail(ORT_INVALID_ARGUMENT, "location escapes the model directory");
      parts.pop_back();
    } else if (!part.empty() && part != ".") {
      parts.push_back(std::move(part));
    }
    pos = end + 1;
  }
  if (parts.empty()) fail(ORT_INVALID_ARGUMENT, "location names no file");
  return parts;
}

}  // namespace

std::shared_ptr<WeightFile> resolve_weight_file(const std::string& model_dir,
                                                const std::string& location) {
  if (model_dir.empty()) fail(ORT_INVALID_ARGUMENT, "no model folder");
  const std::vector<std::string> parts = location_parts(location);
  // The folder itself is the user's choice (it may be reached through a symlink); nothing
  // below it is followed.
  Fd dir(::open(model_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir.get() < 0) {
    const int e = errno;
    fail(e == ENOENT ? ORT_NO_SUCHFILE : ORT_INVALID_ARGUMENT,
         e == ENOENT ? "model directory '" + model_dir + "' does not exist"
                     : "cannot open the model directory '" + model_dir + "': " + errno_text(e));
  }
  std::string shown = model_dir;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    shown += "/" + parts[i];
    const int f = ::openat(dir.get(), parts[i].c_str(),
                           O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (f < 0) {
      const int e = errno;
      fail(e == ENOENT ? ORT_NO_SUCHFILE : ORT_INVALID_ARGUMENT, describe_open_error(shown, e));
    }
    dir.reset(f);
  }
  shown += "/" + parts.back();
  // O_NONBLOCK: a FIFO or device must not block session creation (refused below).
  Fd file(::openat(dir.get(), parts.back().c_str(),
                   O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK | O_NOCTTY));
  if (file.get() < 0) {
    const int e = errno;
    fail(e == ENOENT ? ORT_NO_SUCHFILE : ORT_INVALID_ARGUMENT, describe_open_error(shown, e));
  }
  struct stat st {};
  if (::fstat(file.get(), &st) != 0) {
    fail(ORT_FAIL, "cannot stat '" + shown + "': " + errno_text(errno));
  }
  if (!S_ISREG(st.st_mode)) fail(ORT_INVALID_ARGUMENT, "'" + shown + "' is not a regular file");
  const int flags = ::fcntl(file.get(), F_GETFL);
  if (flags >= 0) (void)::fcntl(file.get(), F_SETFL, flags & ~O_NONBLOCK);
  std::string normalized;
  for (const std::string& p : parts) normalized += (normalized.empty() ? "" : "/") + p;
  return std::make_shared<WeightFile>(file.release(), shown, static_cast<uint64_t>(st.st_size),
                                      st.st_dev, st.st_ino, model_dir, std::move(normalized));
}

std::string data_fingerprint(int fd, uint64_t size) {
  constexpr uint64_t kBlock = 4096;
  uint64_t h = kFnv1aOffset;
  auto feed = [&h](const unsigned char* p, size_t n) { h = fnv1a64(h, p, n); };
  auto feed_u64 = [&feed](uint64_t v) {
    unsigned char b[8];
    for (int i = 0; i < 8; ++i) b[i] = static_cast<unsigned char>(v >> (8 * i));
    feed(b, 8);
  };
  feed_u64(size);
  std::set<uint64_t> offsets;
  for (uint64_t k = 0; k < 16; ++k) {
    // size * k / 16 without overflow for any file size
    offsets.insert((size / 16) * k + ((size % 16) * k) / 16);
  }
  offsets.insert(size > kBlock ? size - kBlock : 0);
  std::vector<unsigned char> buf(kBlock);
  for (uint64_t o : offsets) {
    if (o >= size && size != 0) continue;
    const size_t n = static_cast<size_t>(std::min<uint64_t>(kBlock, size - o));
    feed_u64(o);
    if (n != 0) pread_exact(fd, reinterpret_cast<char*>(buf.data()), n, o, "data file");
    feed(buf.data(), n);
  }
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(h));
  return std::string("fnv1a64s16:") + hex;
}

}  // namespace ho
