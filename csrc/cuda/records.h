// What the CUDA engine's runs leave between their ops (run_records.h): stored activations in
// the pinned ring (a slot each, reused once the copy reading it completed) and the loads in
// flight, keyed by the Prefetch output they are for.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "../channel.h"
#include "../engine.h"
#include "../run_records.h"
#include "device.h"

namespace ho::gpu {

// A ring slot's fence: the event of the last copy that reads the slot.
struct EventFence {
  Lease ev;
  bool ready() const {
    const cudaError_t e = cudaEventQuery(*ev);
    if (e == cudaErrorNotReady) return false;
    // cudaSuccess, or an error that will never let the copy finish (the context is lost):
    // the slot cannot be read any more either way.
    if (e != cudaSuccess) (void)cudaGetLastError();
    return true;
  }
};
using Ring = SlotRing<EventFence>;

class PinnedRingMemory final : public cuda_logic::RingMemory {
 public:
  explicit PinnedRingMemory(size_t bytes) : block_(bytes) {
    counters().host_pool_bytes_reserved += static_cast<int64_t>(bytes);
    counters().ring_segments += 1;
  }
  ~PinnedRingMemory() override {
    counters().host_pool_bytes_reserved -= static_cast<int64_t>(block_.size());
    counters().ring_segments -= 1;
  }
  char* data() override { return block_.data(); }

 private:
  cuda::PinnedBlock block_;
};

class GpuStored final : public StoredTensor {
 public:
  GpuStored(std::vector<int64_t> shape, size_t bytes, ONNXTensorElementDataType type,
            std::shared_ptr<Ring> ring)
      : shape_(std::move(shape)), bytes_(bytes), type_(type), ring_(std::move(ring)) {}
  ~GpuStored() override { release_slot(stored); }
  const std::vector<int64_t>& shape() const override { return shape_; }
  size_t bytes() const override { return bytes_; }
  ONNXTensorElementDataType elem_type() const override { return type_; }

  // The slot returns to the ring; reused once `fence` (the last copy reading it) is done.
  void release_slot(const Lease& fence) {
    if (!slot) return;
    std::optional<EventFence> f;
    if (fence) f = EventFence{fence};
    ring_->release(*slot, std::move(f));
    slot.reset();
    counters().host_pool_bytes_in_use -= static_cast<int64_t>(bytes_);
  }

  std::optional<Ring::Slot> slot;
  Lease stored;  // recorded on the d2h stream after the copy into the slot
  int device = 0;
  uint64_t id = 0;
  Owner owner;  // the run that stored it (run_records.h)

 private:
  std::vector<int64_t> shape_;
  size_t bytes_;
  ONNXTensorElementDataType type_;
  std::shared_ptr<Ring> ring_;
};

// A load in flight, keyed by its destination. `done` is recorded on the h2d stream after
// the last copy; for a disk load it is recorded by an I/O thread, and `issued` tells the
// host when that happened (with the read's error, if any).
struct Pending {
  Lease done;
  StageBuf stage;  // where the load lands (device staging of the engine)
  size_t bytes = 0;
  CompletionPtr issued;  // disk tier only
  std::shared_ptr<std::atomic<bool>> cancelled;  // disk tier only
  Owner owner;  // the run of its Prefetch (run_records.h)

  // Released without its Wait (a failed run's load): it writes only its own staging buffer
  // (released with its fence when its last copy is enqueued); a disk load stops issuing
  // more copies.
  void abandon() {
    if (cancelled) cancelled->store(true);
  }
};

using Records = RunRecords<GpuStored, Pending>;
using Released = Records::Released;

}  // namespace ho::gpu
