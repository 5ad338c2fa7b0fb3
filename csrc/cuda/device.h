// The CUDA engine's resources per device, shared by every engine of the process
// (shared_device): the copy streams (one FIFO per direction, like the hardware's copy
// engines), the event pools, the device staging that loads land in (the transfer lifetime
// rule, docs/design.md) and the pinned staging of streamed reads.
#pragma once

#include <cuda_runtime.h>

#include <condition_variable>
#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "../common.h"
#include "../disk_io.h"
#include "cuda_util.h"
#include "host_logic.h"

namespace ho::gpu {

using cuda::check;
using cuda_logic::EventPool;
using cuda_logic::SlotRing;

// Events without timing (cheapest to record and wait on).
struct EventTraits {
  using Event = cudaEvent_t;
  int device = 0;
  bool timing = false;
  cudaEvent_t create() const {
    cuda::set_device(device);
    cudaEvent_t e = nullptr;
    check(cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming),
          "cudaEventCreateWithFlags");
    counters().cuda_events_created += 1;
    return e;
  }
  void destroy(cudaEvent_t e) const noexcept { cuda::ignore(cudaEventDestroy(e)); }
};
using Pool = EventPool<EventTraits>;
using Lease = Pool::Lease;

// Pinned staging buffers for disk reads; each one is reused only after the copy out of it
// completed (host-side event sync on an I/O thread, never on a compute thread).
class Staging {
 public:
  struct Buf {
    Buf() = default;
    Buf(const Buf&) = delete;
    Buf& operator=(const Buf&) = delete;
    // RAII: also on a constructor error path of Staging (the buffers made so far).
    ~Buf() {
      if (ev == nullptr) return;
      if (recorded) cuda::ignore(cudaEventSynchronize(ev));  // the copy reading `mem`
      cuda::ignore(cudaEventDestroy(ev));
    }
    std::unique_ptr<cuda::PinnedBlock> mem;
    cudaEvent_t ev = nullptr;
    bool recorded = false;
  };
  Staging(int device, size_t count, size_t bytes) : device_(device) {
    cuda::set_device(device);
    for (size_t i = 0; i < count; ++i) {
      auto b = std::make_unique<Buf>();
      b->mem = std::make_unique<cuda::PinnedBlock>(bytes);
      check(cudaEventCreateWithFlags(&b->ev, cudaEventDisableTiming), "cudaEventCreateWithFlags");
      counters().cuda_events_created += 1;
      free_.push_back(b.get());
      all_.push_back(std::move(b));
    }
  }
  ~Staging() = default;  // each Buf waits for its last copy, then frees its event
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;

  Buf* acquire() {
    Buf* b = nullptr;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return !free_.empty(); });
      b = free_.back();
      free_.pop_back();
    }
    if (b->recorded) {
      const cudaError_t e = cudaEventSynchronize(b->ev);
      if (e != cudaSuccess) {
        release(b);
        check(e, "cudaEventSynchronize (disk staging)");
      }
      b->recorded = false;
    }
    return b;
  }
  void release(Buf* b) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      free_.push_back(b);
    }
    cv_.notify_one();
  }
  int device() const { return device_; }

 private:
  int device_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Buf*> free_;
  std::vector<std::unique_ptr<Buf>> all_;
};

// Device staging of loads (the transfer lifetime rule, docs/design.md): a Prefetch's copy
// lands here, never in ORT's Prefetch output, and the Wait copies it into its own output on
// the compute stream. A failed run's copy therefore writes only memory of the library.
// Buffers are reused by size; each carries a fence, the event after the last copy that
// wrote or read it, and its next writer makes its stream wait on that fence first (a
// stream-side wait: the host never blocks). Nothing is allocated per run once warm.
class DeviceStaging : public std::enable_shared_from_this<DeviceStaging> {
 public:
  class Buf {
   public:
    Buf(std::shared_ptr<DeviceStaging> pool, std::unique_ptr<cuda::DeviceBuffer> mem,
        size_t bytes, Lease fence)
        : fence(std::move(fence)), pool_(std::move(pool)), mem_(std::move(mem)), bytes_(bytes) {}
    ~Buf() { pool_->release(std::move(mem_), bytes_, std::move(fence)); }
    Buf(const Buf&) = delete;
    Buf& operator=(const Buf&) = delete;
    void* data() const { return mem_->data(); }

    Lease fence;  // the last copy that used the buffer (set by that copy's issuer)

   private:
    std::shared_ptr<DeviceStaging> pool_;
    std::unique_ptr<cuda::DeviceBuffer> mem_;
    size_t bytes_;
  };

  explicit DeviceStaging(int device) : device_(device) {}
  ~DeviceStaging() {
    for (auto& kv : free_) {
      if (kv.second.second) cuda::ignore(cudaEventSynchronize(*kv.second.second));
    }
    counters().device_staging_bytes -= static_cast<int64_t>(held_);
  }
  DeviceStaging(const DeviceStaging&) = delete;
  DeviceStaging& operator=(const DeviceStaging&) = delete;

  // A buffer of `bytes` bytes; its `fence` (if set) must be waited for by the writer's stream.
  std::shared_ptr<Buf> acquire(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.find(bytes);
      if (it != free_.end()) {
        auto entry = std::move(it->second);
        free_.erase(it);
        return std::make_shared<Buf>(shared_from_this(), std::move(entry.first), bytes,
                                     std::move(entry.second));
      }
    }
    auto mem = std::make_unique<cuda::DeviceBuffer>(device_, bytes);
    counters().device_staging_bytes += static_cast<int64_t>(bytes);
    {
      std::lock_guard<std::mutex> lock(mu_);
      held_ += bytes;
    }
    return std::make_shared<Buf>(shared_from_this(), std::move(mem), bytes, Lease());
  }

 private:
  void release(std::unique_ptr<cuda::DeviceBuffer> mem, size_t bytes, Lease fence) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.emplace(bytes, std::make_pair(std::move(mem), std::move(fence)));
  }

  int device_;
  std::mutex mu_;
  size_t held_ = 0;  // bytes of every buffer made (device_staging_bytes' share of this pool)
  std::multimap<size_t, std::pair<std::unique_ptr<cuda::DeviceBuffer>, Lease>> free_;
};
using StageBuf = std::shared_ptr<DeviceStaging::Buf>;

// The copy streams and event pools of one device, shared by every engine of the process
// (shared_device): one FIFO per direction and device, like the hardware's copy engines.
struct Device {
  explicit Device(int dev)
      : id(dev),
        h2d(dev),
        d2h(dev),
        events(std::make_shared<Pool>(EventTraits{dev, false})),
        timing(std::make_shared<Pool>(EventTraits{dev, true})),
        loads(std::make_shared<DeviceStaging>(dev)) {
    events->prewarm(64);
  }
  const int id;
  cuda::Stream h2d;  // the load channel: host-to-device copies, FIFO
  cuda::Stream d2h;  // the store channel: device-to-host copies, FIFO
  std::shared_ptr<Pool> events;
  std::shared_ptr<Pool> timing;
  std::shared_ptr<DeviceStaging> loads;  // device staging of loads (lifetime rule)
  std::mutex staging_mu;
  std::unique_ptr<Staging> staging;  // created when an engine has disk-tier weights

  Staging& need_staging() {
    std::lock_guard<std::mutex> lock(staging_mu);
    if (!staging) {
      // Two pinned chunk buffers per I/O thread: one read while the other is copied.
      staging = std::make_unique<Staging>(id, 2 * static_cast<size_t>(disk_io_threads()),
                                          disk_chunk_bytes());
    }
    return *staging;
  }
};

// The device `device`'s resources, made by the first engine that uses it and shared while
// some engine holds them.
std::shared_ptr<Device> shared_device(int device);

}  // namespace ho::gpu
