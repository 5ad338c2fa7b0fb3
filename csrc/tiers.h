// The storage tiers weights load from: one entry each (csrc/tiers.cc), the C++ side of the
// Python tier registry (ho_onnx/kinds.py, StorageTier: same names, and `in_host_memory`).
//
// An entry says how a weight's bytes are obtained: `open` gives the weight's WeightSource
// (the tier's I/O class: it reads the bytes from wherever the tier keeps them), and
// `in_host_memory` how the engines copy them into the fast tier:
//  - in host memory (host): read once, at session creation, into the engine's host store
//    (Engine::load_weight), and copied from there at every Prefetch (Engine::prefetch_weight);
//  - streamed (disk): read again at every Prefetch, in chunks, by the engine's I/O channel
//    into its staging (Engine::prefetch_streamed; Engine::prepare_streamed at session
//    creation).
// The engines know these two movements, not the tiers: a further tier (remote) is one entry
// in tiers.cc and its WeightSource class. Kernels look the `tier` attribute up here
// (kernel.cc: weight_range, init_weight).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace ho {

class WeightFile;

// The bytes [offset(), offset() + size()) of one weight where its tier keeps them.
class WeightSource {
 public:
  WeightSource(uint64_t offset, size_t size, std::string name)
      : offset_(offset), size_(size), who_("weight '" + name + "'") {}
  virtual ~WeightSource() = default;
  WeightSource(const WeightSource&) = delete;
  WeightSource& operator=(const WeightSource&) = delete;

  // Where the weight starts in its source (chunks and staging are aligned to it: O_DIRECT).
  uint64_t offset() const { return offset_; }
  size_t size() const { return size_; }
  const std::string& who() const { return who_; }  // for messages

  // Read bytes [pos, pos + n) of the source, within the weight's range, into `out`. Called
  // concurrently by I/O threads (streamed tiers) or once at session creation (tiers in host
  // memory). Throws ho::Error naming the weight.
  virtual void read(uint64_t pos, size_t n, char* out) const = 0;

 private:
  uint64_t offset_;
  size_t size_;
  std::string who_;
};

// The chunks a streamed load reads, in order: [begin, end) cut at multiples of `chunk` of
// the source (a chunk's reads stay aligned as the source is: O_DIRECT), each a job of the
// I/O channel. Empty for an empty range.
struct Chunks {
  uint64_t begin = 0;
  uint64_t end = 0;
  uint64_t chunk = 1;
  size_t count() const {
    return end == begin ? 0 : static_cast<size_t>((end - 1) / chunk - begin / chunk + 1);
  }
  // The end of the chunk that starts at `pos`.
  uint64_t after(uint64_t pos) const {
    const uint64_t cut = (pos / chunk + 1) * chunk;
    return cut < end ? cut : end;
  }
};
inline Chunks chunks_of(const WeightSource& src, uint64_t chunk) {
  return Chunks{src.offset(), src.offset() + src.size(), chunk};
}

struct WeightTier {
  const char* name;     // the Prefetch's `tier` attribute (absent: the first entry, host)
  bool in_host_memory;  // true: the host store holds it; false: streamed at every Prefetch
  // The weight `name`'s source: bytes [offset, offset + length) of the validated data file
  // `file` (the model's external data). Throws ho::Error (e.g. a range past the file's end).
  std::shared_ptr<const WeightSource> (*open)(const std::shared_ptr<WeightFile>& file,
                                              int64_t offset, int64_t length,
                                              const std::string& name);
};

// The host stores' key of `src`'s bytes: `content` (Registration::content_key of its data
// file: a file rewritten in place is never served from an earlier version's bytes), offset
// and size.
std::string weight_key(const WeightSource& src, const std::string& content);

// The registered tiers (terminated by an entry with a null name); the first is the default.
const WeightTier* weight_tiers();
// The tier named `name`, or null.
const WeightTier* find_tier(const std::string& name);
// "host or disk": the registered names, for messages.
std::string tier_names();

}  // namespace ho
