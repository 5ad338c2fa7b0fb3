// Host-side bookkeeping of the CUDA engine, free of any CUDA call so that it is compiled in
// every build and unit-tested on machines without a GPU (module.cc: _ops._test_*).
//
//  * EventPool<Traits>: recycles event handles (cudaEvent_t in the engine, a counter in the
//    tests); a Lease returns its event to the pool when the last copy of it goes away.
//  * SlotRing<Fence>: the pinned ring buffer of stored activations. Slots are handed out in
//    allocation order from segments; a released slot is reclaimed only when it reaches the
//    ring's tail AND its fence (the event of the last copy that reads it) is ready. When no
//    segment has room the ring grows by a segment: acquire() never waits, so concurrent runs
//    can never deadlock on host memory.
//  * ring_capacity(): the first segment's size from the plan's recorded host bytes.
//  * WeightPacker: where each pinned weight goes (own block, packed into a shared chunk or
//    into a slab of its data file), so that few blocks are pinned and pinned memory stays
//    within ~1.1x the weights' bytes for realistic models.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace ho {
namespace cuda_logic {

inline size_t align_up(size_t x, size_t a) { return a == 0 ? x : (x + a - 1) / a * a; }

// ---------------------------------------------------------------------------------------
// Event pool. Traits: `using Event = ...; Event create(); void destroy(Event) noexcept;`
// create() may throw (the engine's turns a CUDA error into an ho::Error).
template <class Traits>
class EventPool : public std::enable_shared_from_this<EventPool<Traits>> {
 public:
  using Event = typename Traits::Event;
  // An event on loan; the last copy of a Lease gives it back.
  using Lease = std::shared_ptr<const Event>;

  explicit EventPool(Traits traits) : traits_(std::move(traits)) {}
  ~EventPool() {
    for (Event e : free_) traits_.destroy(e);
  }
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;

  // Create `n` events up front (session creation), so runs never create one.
  void prewarm(size_t n) {
    std::vector<Event> made;
    for (size_t i = 0; i < n; ++i) made.push_back(traits_.create());
    std::lock_guard<std::mutex> lock(mu_);
    created_ += made.size();
    free_.insert(free_.end(), made.begin(), made.end());
  }

  Lease acquire() {
    Event e{};
    bool have = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!free_.empty()) {
        e = free_.back();
        free_.pop_back();
        have = true;
      }
      ++outstanding_;
    }
    if (!have) {
      try {
        e = traits_.create();
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu_);
        --outstanding_;
        throw;
      }
      std::lock_guard<std::mutex> lock(mu_);
      ++created_;
    }
    auto self = this->shared_from_this();
    return Lease(new Event(e), [self](const Event* p) {
      self->release(*p);
      delete p;
    });
  }

  size_t created() const {
    std::lock_guard<std::mutex> lock(mu_);
    return created_;
  }
  size_t free_count() const {
    std::lock_guard<std::mutex> lock(mu_);
    return free_.size();
  }
  size_t outstanding() const {
    std::lock_guard<std::mutex> lock(mu_);
    return outstanding_;
  }

 private:
  void release(Event e) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(e);
    --outstanding_;
  }

  Traits traits_;
  mutable std::mutex mu_;
  std::vector<Event> free_;
  size_t created_ = 0;
  size_t outstanding_ = 0;
};

// ---------------------------------------------------------------------------------------
// Ring of pinned slots.

// The memory of one segment (pinned in the engine, plain or none in the tests).
class RingMemory {
 public:
  virtual ~RingMemory() = default;
  virtual char* data() = 0;  // may be null in the logic tests
};

// `Fence`: copyable, `bool ready() const` (true once the GPU work it stands for finished).
template <class Fence>
class SlotRing {
 public:
  struct Slot {
    void* data = nullptr;
    size_t segment = 0;
    size_t offset = 0;
    size_t size = 0;
    uint64_t id = 0;
  };
  struct Stats {
    size_t segments = 0;
    size_t capacity = 0;   // bytes of all segments
    size_t in_use = 0;     // bytes of slots acquired and not yet reclaimed
    size_t live = 0;       // slots acquired and not yet reclaimed (released or not)
    size_t released = 0;   // of those, released and waiting for their fence / the tail
    uint64_t acquired_total = 0;
    uint64_t reclaimed_total = 0;
  };
  using SegmentAlloc = std::function<std::unique_ptr<RingMemory>(size_t bytes)>;

  // `align`: slot alignment (and size granularity); `growth`: the least size of a segment
  // added when no segment has room.
  SlotRing(SegmentAlloc alloc, size_t align, size_t growth)
      : alloc_(std::move(alloc)), align_(align == 0 ? 1 : align), growth_(growth) {}
  SlotRing(const SlotRing&) = delete;
  SlotRing& operator=(const SlotRing&) = delete;

  // Make the total capacity at least `bytes` (one more segment for what is missing).
  void reserve(size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    size_t cap = capacity_locked();
    if (cap >= bytes) return;
    add_segment_locked(align_up(bytes - cap, align_));
  }

  // A slot of `size` (> 0) bytes. Never waits: reclaims what is ready, else grows.
  Slot acquire(size_t size) {
    if (size == 0) throw std::invalid_argument("SlotRing::acquire: size 0");
    const size_t need = align_up(size, align_);
    std::lock_guard<std::mutex> lock(mu_);
    reap_locked();
    for (size_t s = 0; s < segs_.size(); ++s) {
      size_t off = 0;
      if (fits_locked(*segs_[s], need, &off)) return place_locked(s, off, need);
    }
    const size_t s = add_segment_locked(std::max(need, growth_));
    return place_locked(s, 0, need);
  }

  // Give `slot` back; its bytes are reused once `fence` is ready (no fence: at once).
  void release(const Slot& slot, std::optional<Fence> fence) {
    std::lock_guard<std::mutex> lock(mu_);
    if (slot.segment >= segs_.size()) throw std::invalid_argument("SlotRing::release: bad slot");
    for (Entry& e : segs_[slot.segment]->live) {
      if (e.id == slot.id) {
        if (e.released) throw std::logic_error("SlotRing::release: slot released twice");
        e.released = true;
        e.fence = std::move(fence);
        reap_locked();
        return;
      }
    }
    throw std::invalid_argument("SlotRing::release: unknown slot");
  }

  // Reclaim every released slot whose fence is ready (and everything ahead of it is too).
  void reap() {
    std::lock_guard<std::mutex> lock(mu_);
    reap_locked();
  }

  Stats stats() const {
    std::lock_guard<std::mutex> lock(mu_);
    Stats st = stats_;
    st.segments = segs_.size();
    st.capacity = capacity_locked();
    st.live = 0;
    st.released = 0;
    st.in_use = 0;
    for (const auto& seg : segs_) {
      for (const Entry& e : seg->live) {
        ++st.live;
        st.in_use += e.size;
        if (e.released) ++st.released;
      }
    }
    return st;
  }

 private:
  struct Entry {
    uint64_t id;
    size_t offset;
    size_t size;
    bool released = false;
    std::optional<Fence> fence;
  };
  struct Segment {
    std::unique_ptr<RingMemory> mem;
    size_t capacity = 0;
    std::deque<Entry> live;  // in allocation order: front = tail of the ring
  };

  size_t capacity_locked() const {
    size_t c = 0;
    for (const auto& s : segs_) c += s->capacity;
    return c;
  }

  size_t add_segment_locked(size_t bytes) {
    auto seg = std::make_unique<Segment>();
    seg->mem = alloc_(bytes);
    seg->capacity = bytes;
    segs_.push_back(std::move(seg));
    return segs_.size() - 1;
  }

  // The used region of a segment runs from the front entry (tail) to the end of the back
  // entry (head), wrapping at most once.
  static bool fits_locked(const Segment& seg, size_t need, size_t* off) {
    if (need > seg.capacity) return false;
    if (seg.live.empty()) {
      *off = 0;
      return true;
    }
    const size_t tail = seg.live.front().offset;
    const size_t head = seg.live.back().offset + seg.live.back().size;
    const bool wrapped = seg.live.back().offset < tail;
    if (!wrapped) {
      if (head + need <= seg.capacity) {
        *off = head;
        return true;
      }
      if (need <= tail) {  // wrap to the start
        *off = 0;
        return true;
      }
      return false;
    }
    if (head + need <= tail) {
      *off = head;
      return true;
    }
    return false;
  }

  Slot place_locked(size_t s, size_t off, size_t need) {
    Segment& seg = *segs_[s];
    const uint64_t id = ++next_id_;
    seg.live.push_back(Entry{id, off, need, false, std::nullopt});
    ++stats_.acquired_total;
    Slot slot;
    char* base = seg.mem ? seg.mem->data() : nullptr;
    slot.data = base == nullptr ? nullptr : base + off;
    slot.segment = s;
    slot.offset = off;
    slot.size = need;
    slot.id = id;
    return slot;
  }

  void reap_locked() {
    for (auto& seg : segs_) {
      while (!seg->live.empty()) {
        Entry& e = seg->live.front();
        if (!e.released) break;
        if (e.fence && !e.fence->ready()) break;
        seg->live.pop_front();
        ++stats_.reclaimed_total;
      }
    }
  }

  SegmentAlloc alloc_;
  const size_t align_;
  const size_t growth_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Segment>> segs_;
  uint64_t next_id_ = 0;
  Stats stats_;
};

// Slot alignment of the ring (also a good DMA alignment).
constexpr size_t kRingAlign = 256;
// The least size of a segment added when the ring grows.
constexpr size_t kRingGrowth = size_t{64} << 20;

// The first segment for a plan that stores `host_bytes` bytes of activations per run: one
// run must fit without any reuse, so the segment holds every slot of a run with its
// alignment padding (at most kRingAlign per slot; the planner never stores tensors under
// 64 KiB, hence the 1/256 margin), rounded up to 64 KiB.
inline size_t ring_capacity(size_t host_bytes) {
  if (host_bytes == 0) return 0;
  return align_up(host_bytes + host_bytes / 256 + (size_t{64} << 10), size_t{64} << 10);
}

// ---------------------------------------------------------------------------------------
// Pinned weights, by size, so that few blocks are pinned (each cudaHostRegister has a cost of
// its own) and the pinned bytes stay close to the weights' bytes:
//  * small (< kOwnBlockMin, 256 KiB): packed at 256-byte alignment into shared chunks of
//    kChunk (4 MiB); a chunk's unused tail when the next weight does not fit is < 1/16 of it;
//  * medium (up to kSlabMax / 16, 4 MiB: an MoE expert's matrix): packed at page alignment
//    into slabs of their group (a data file's version: its weights come and go together),
//    the group's k-th slab min(kSlabMax, kChunk << k) bytes; the unused tail of a full slab
//    is < 4 MiB (< 1/16 of a 64 MiB slab);
//  * large: a page-rounded block of its own (waste < 4 KiB).
// So the pinned bytes are at most ~1.07x the weights' plus one partly filled chunk (< 4 MiB)
// and, per group with medium weights, its last slab's unfilled part (< 64 MiB, and less
// than 4 MiB plus the group's earlier slabs). A 2 GiB model of 610 3-MiB experts pins 34
// blocks instead of 610.
class WeightPacker {
 public:
  static constexpr size_t kPage = 4096;
  static constexpr size_t kAlign = 256;
  static constexpr size_t kOwnBlockMin = size_t{256} << 10;
  static constexpr size_t kChunk = size_t{4} << 20;
  static constexpr size_t kSlabMax = size_t{64} << 20;
  static constexpr size_t kMediumMax = kSlabMax / 16;

  enum class Kind { kOwn, kChunk, kSlab };
  struct Placement {
    Kind kind = Kind::kOwn;
    size_t block_bytes = 0;  // own block: its size; chunk/slab: the size of a new one, or 0
    size_t block = 0;        // chunk/slab: its index (chunks and slabs counted apart)
    size_t offset = 0;       // chunk/slab: offset in it
    bool own_block() const { return kind == Kind::kOwn; }
  };

  // Where a weight of `bytes` of `group` goes; a new chunk or slab is opened when the current
  // one is full (Placement::block_bytes != 0 then: allocate it before using the placement).
  Placement place(size_t bytes, const std::string& group = std::string()) {
    Placement p;
    payload_ += bytes;
    if (bytes >= kOwnBlockMin && bytes <= kMediumMax) {
      p.kind = Kind::kSlab;
      Slabs& g = groups_[group];
      const size_t need = align_up(bytes, kPage);
      if (g.cap == 0 || g.used + need > g.cap) {
        g.cap = std::min(kSlabMax, kChunk << std::min<size_t>(g.opened, 4));
        g.used = 0;
        ++g.opened;
        ++slabs_;
        reserved_ += g.cap;
        p.block_bytes = g.cap;
        g.index = slabs_ - 1;
      }
      p.block = g.index;
      p.offset = g.used;
      g.used += need;
      return p;
    }
    if (bytes >= kOwnBlockMin) {
      p.block_bytes = align_up(bytes, kPage);
      reserved_ += p.block_bytes;
      return p;
    }
    p.kind = Kind::kChunk;
    const size_t need = align_up(bytes == 0 ? 1 : bytes, kAlign);
    if (chunks_ == 0 || used_ + need > kChunk) {
      p.block_bytes = kChunk;
      reserved_ += kChunk;
      ++chunks_;
      used_ = 0;
    }
    p.block = chunks_ - 1;
    p.offset = used_;
    used_ += need;
    return p;
  }

  // `group`'s current slab is gone (all its weights were dropped): its next medium weight
  // opens a new slab, as small as the group's first. Forgotten groups take no memory here.
  void forget(const std::string& group) { groups_.erase(group); }

  size_t reserved() const { return reserved_; }  // bytes of every block ever opened
  size_t payload() const { return payload_; }
  size_t chunks() const { return chunks_; }
  size_t slabs() const { return slabs_; }
  size_t groups() const { return groups_.size(); }

 private:
  struct Slabs {
    size_t opened = 0;  // slabs opened for the group so far
    size_t cap = 0;     // the current slab's size (0: none)
    size_t used = 0;
    size_t index = 0;   // the current slab's index
  };
  size_t reserved_ = 0;
  size_t payload_ = 0;
  size_t chunks_ = 0;
  size_t slabs_ = 0;
  size_t used_ = 0;
  std::map<std::string, Slabs> groups_;
};

}  // namespace cuda_logic
}  // namespace ho
