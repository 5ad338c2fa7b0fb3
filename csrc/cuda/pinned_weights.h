// The CUDA engine's host store of weights: tiers in host memory (tiers.h) read straight into
// pinned blocks, small weights packed into shared chunks and medium ones into slabs of their
// data file (host_logic.h: WeightPacker).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "../engine.h"
#include "../tiers.h"
#include "../weak_cache.h"
#include "cuda_util.h"
#include "host_logic.h"

namespace ho::gpu {

class PinnedBlob final : public HostBlob {
 public:
  PinnedBlob(std::shared_ptr<cuda::PinnedBlock> block, char* p, size_t size)
      : block_(std::move(block)), p_(p), size_(size) {
    counters().host_store_bytes += static_cast<int64_t>(size_);
  }
  ~PinnedBlob() override { counters().host_store_bytes -= static_cast<int64_t>(size_); }
  const void* data() const override { return p_; }
  size_t size() const override { return size_; }

 private:
  std::shared_ptr<cuda::PinnedBlock> block_;
  char* p_;
  size_t size_;
};

// What must happen before a pinned weight block is unpinned: every copy that may read it
// done (a failed run's load can still be in flight when its session goes). `sync` is the
// engine's (it synchronizes its copy streams); empty once the engine has synchronized them
// for good at its end.
struct CopyDrain {
  std::mutex mu;
  std::function<void()> sync;
};

// Weights in pinned host memory, keyed by content (Registration::content_key: a data file
// rewritten in place is never served from an earlier version's bytes) and held only while a
// session's kernels hold them: a hot-swapped version's weights go with its last session.
// Small weights are packed into shared chunks (WeightPacker); a block is unpinned when its
// last weight goes, after the copy streams are drained.
class PinnedWeights {
 public:
  explicit PinnedWeights(std::shared_ptr<CopyDrain> drain) : drain_(std::move(drain)) {}

  std::shared_ptr<const HostBlob> load(const WeightSource& src, const std::string& content) {
    return blobs_.get(weight_key(src, content),
                      [&]() -> std::shared_ptr<const HostBlob> { return place(src, content); });
  }

 private:
  // Pins `src`'s bytes (under the cache's lock: the packer's chunk and slabs are shared).
  // Medium weights share slabs with the other weights of their data file's version
  // (`content`), which come and go with it.
  std::shared_ptr<const HostBlob> place(const WeightSource& src, const std::string& content) {
    const size_t n = src.size();
    if (n >= cuda_logic::WeightPacker::kOwnBlockMin && n <= cuda_logic::WeightPacker::kMediumMax &&
        slabs_[content].expired()) {
      packer_.forget(content);  // its last slab went with its weights: start small again
    }
    const cuda_logic::WeightPacker::Placement p = packer_.place(n, content);
    std::shared_ptr<cuda::PinnedBlock> block;
    char* dst = nullptr;
    switch (p.kind) {
      case cuda_logic::WeightPacker::Kind::kOwn:
        block = pinned(p.block_bytes);
        dst = block->data();
        break;
      case cuda_logic::WeightPacker::Kind::kChunk:
        if (p.block_bytes != 0) chunk_ = pinned(p.block_bytes);
        block = chunk_;
        dst = block->data() + p.offset;
        break;
      case cuda_logic::WeightPacker::Kind::kSlab:
        block = p.block_bytes != 0 ? pinned(p.block_bytes) : slabs_[content].lock();
        if (!block) fail(ORT_FAIL, "internal: a weight placed in a slab that is gone");
        slabs_[content] = block;  // weak: the slab goes with its last weight
        dst = block->data() + p.offset;
        sweep_slabs();
        break;
    }
    // Straight into pinned memory: no pageable copy in between.
    if (n != 0) src.read(src.offset(), n, dst);
    return std::make_shared<PinnedBlob>(std::move(block), dst, n);
  }

  // Drops the groups whose slabs are gone, once their count has doubled since the last time.
  void sweep_slabs() {
    if (slabs_.size() < 2 * slabs_swept_ + 16) return;
    for (auto it = slabs_.begin(); it != slabs_.end();) {
      if (it->second.expired()) {
        packer_.forget(it->first);
        it = slabs_.erase(it);
      } else {
        ++it;
      }
    }
    slabs_swept_ = slabs_.size();
  }

  // A pinned block whose release first drains the copy streams.
  std::shared_ptr<cuda::PinnedBlock> pinned(size_t bytes) {
    std::shared_ptr<CopyDrain> drain = drain_;
    return std::shared_ptr<cuda::PinnedBlock>(
        new cuda::PinnedBlock(bytes), [drain](cuda::PinnedBlock* b) {
          {
            std::lock_guard<std::mutex> lock(drain->mu);
            if (drain->sync) drain->sync();
          }
          delete b;
        });
  }

  std::shared_ptr<CopyDrain> drain_;
  cuda_logic::WeightPacker packer_;
  std::shared_ptr<cuda::PinnedBlock> chunk_;  // the chunk small weights are packed into
  // Per data file version: the slab its medium weights are packed into (held by them).
  std::map<std::string, std::weak_ptr<cuda::PinnedBlock>> slabs_;
  size_t slabs_swept_ = 0;
  WeakCache<const HostBlob> blobs_;
};

}  // namespace ho::gpu
