#include "tiers.h"

#include <memory>
#include <string>
#include <utility>

#include "common.h"
#include "disk_io.h"
#include "weight_file.h"

namespace ho {

namespace {

// A weight's byte range of a data file held open as a `File`.
template <typename File>
class FileSource : public WeightSource {
 public:
  FileSource(std::shared_ptr<File> file, int64_t offset, int64_t length, const std::string& name)
      : WeightSource(static_cast<uint64_t>(offset), static_cast<size_t>(length), name),
        file_(std::move(file)) {}

 protected:
  std::shared_ptr<File> file_;
};

// host: the data file read with pread at session creation, into the host store.
class FileRange final : public FileSource<WeightFile> {
 public:
  using FileSource::FileSource;
  void read(uint64_t pos, size_t n, char* out) const override {
    pread_exact(file_->fd(), out, n, pos, file_->path());
  }
};

std::shared_ptr<const WeightSource> open_host(const std::shared_ptr<WeightFile>& file,
                                              int64_t offset, int64_t length,
                                              const std::string& name) {
  if (offset < 0 || length < 0) fail(ORT_INVALID_ARGUMENT, "negative offset or length");
  return std::make_shared<FileRange>(file, offset, length, name);
}

// disk: positional reads of the data file at every Prefetch, page cache bypassed where the
// file system allows it (disk_io.h), timed by the disk-busy clock.
class DiskRange final : public FileSource<DiskFile> {
 public:
  using FileSource::FileSource;
  void read(uint64_t pos, size_t n, char* out) const override {
    DiskBusy busy;
    if (file_->read(pos, n, out, nullptr, who())) counters().bytes_read_disk += n;
  }
};

DiskFiles& disk_files() {
  static auto* files = new DiskFiles();  // never freed (I/O threads may outlive statics)
  return *files;
}

std::shared_ptr<const WeightSource> open_disk(const std::shared_ptr<WeightFile>& file,
                                              int64_t offset, int64_t length,
                                              const std::string& name) {
  std::shared_ptr<DiskFile> f = disk_files().open_range(*file, offset, length);
  return std::make_shared<DiskRange>(std::move(f), offset, length, name);
}

// The registry. A further tier: one entry here and its WeightSource class above (or in a
// file of its own), plus register_tier in ho_onnx/kinds.py (docs/design.md, "Adding a
// tensor kind or a tier").
const WeightTier kTiers[] = {
    {"host", true, open_host},
    {"disk", false, open_disk},
    {nullptr, false, nullptr},
};

}  // namespace

std::string weight_key(const WeightSource& src, const std::string& content) {
  return content + "\n" + std::to_string(src.offset()) + "\n" + std::to_string(src.size());
}

const WeightTier* weight_tiers() { return kTiers; }

const WeightTier* find_tier(const std::string& name) {
  for (const WeightTier* t = kTiers; t->name != nullptr; ++t) {
    if (name == t->name) return t;
  }
  return nullptr;
}

std::string tier_names() {
  std::string s;
  for (const WeightTier* t = kTiers; t->name != nullptr; ++t) {
    if (!s.empty()) s += (t + 1)->name == nullptr ? " or " : ", ";
    s += t->name;
  }
  return s;
}

}  // namespace ho
