// The CUDA engine's host store of weights: tiers in host memory (tiers.h) read straight into
// pinned blocks, small weights packed into shared chunks (host_logic.h: WeightPacker).
#pragma once

#include <functional>
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
                      [&]() -> std::shared_ptr<const HostBlob> { return place(src); });
  }

 private:
  // Pins `src`'s bytes (under the cache's lock: the packer's chunk is shared).
  std::shared_ptr<const HostBlob> place(const WeightSource& src) {
    const size_t n = src.size();
    const cuda_logic::WeightPacker::Placement p = packer_.place(n);
    std::shared_ptr<cuda::PinnedBlock> block;
    char* dst = nullptr;
    if (p.own_block) {
      block = pinned(p.block_bytes);
      dst = block->data();
    } else {
      if (p.block_bytes != 0) chunk_ = pinned(p.block_bytes);
      block = chunk_;
      dst = block->data() + p.offset;
    }
    // Straight into pinned memory: no pageable copy in between.
    if (n != 0) src.read(src.offset(), n, dst);
    return std::make_shared<PinnedBlob>(std::move(block), dst, n);
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
  WeakCache<const HostBlob> blobs_;
};

}  // namespace ho::gpu
