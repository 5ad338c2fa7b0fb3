// The pybind11 module ho_onnx._ops_testing, built only in a testing build (CMake
// HO_ONNX_TESTING=ON: editable installs, scripts/test_native.sh, scripts/gpu_run.sh), never
// shipped: the fault hooks of the testing C API (ho_onnx_testing.h: set_debug) and harnesses
// of the header-only logic the engines are made of, driven by the tests directly: the CUDA
// engine's event pool, slot ring and weight packer (cuda/host_logic.h), both engines'
// run-owned records (run_records.h) and the host pool's size classes (pool_class.h).
// Like ho_onnx._ops it links to libho_onnx_ops.so next to it: one copy of the library's state.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../cuda/host_logic.h"
#include "../pool_class.h"
#include "../py_switches.h"
#include "../run_records.h"
#include "ho_onnx_testing.h"

namespace py = pybind11;

namespace {

// Every fault hook of HoOnnxTest_SetFault: set_debug(**kw) sets those named and resets the
// rest.
const char* const kFaultHooks[] = {"delay_us",         "poison",          "skip_wait",
                                   "skip_staging_fence", "skip_detach_wait", "skip_wait_event",
                                   "skip_store_start", "compute_delay_us"};

void set_debug(const py::kwargs& kw) {
  ho_py::set_switches<int64_t>(kw, kFaultHooks, HoOnnxTest_SetFault, "set_debug", "hook");
}

// ---------------------------------------------------------------------------------------
// Harnesses of the CUDA engine's host-side logic (csrc/cuda/host_logic.h, header-only, so
// tested in every build, CUDA or not). The event is the only stand-in: a number from a counter, and a fence is a
// flag the test (or a completer thread) sets - the pool and ring code is the engine's own.

namespace cl = ho::cuda_logic;

struct CountingEvents {
  using Event = int64_t;
  std::shared_ptr<std::atomic<int64_t>> next = std::make_shared<std::atomic<int64_t>>(0);
  std::shared_ptr<std::atomic<int64_t>> destroyed = std::make_shared<std::atomic<int64_t>>(0);
  int64_t create() const { return ++*next; }
  void destroy(int64_t) const noexcept { ++*destroyed; }
};
using TestPool = cl::EventPool<CountingEvents>;

struct TestLease {
  TestPool::Lease lease;
  int64_t id() const {
    if (!lease) throw std::runtime_error("lease released");
    return *lease;
  }
  void release() { lease.reset(); }
};

class TestEventPool {
 public:
  TestEventPool() : pool_(std::make_shared<TestPool>(traits_)) {}
  TestLease acquire() { return TestLease{pool_->acquire()}; }
  void prewarm(size_t n) { pool_->prewarm(n); }
  size_t created() const { return pool_->created(); }
  size_t free_count() const { return pool_->free_count(); }
  size_t outstanding() const { return pool_->outstanding(); }
  int64_t destroyed() const { return traits_.destroyed->load(); }
  void close() { pool_.reset(); }  // destroy the pool (events come back from live leases)
  // `threads` threads each acquire up to `hold` events, release them, `iters` times.
  // Returns the largest number of events on loan at once (seen by the threads).
  size_t stress(int threads, int iters, int hold) {
    py::gil_scoped_release nogil;
    std::atomic<size_t> out{0}, peak{0};
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t) {
      ts.emplace_back([&] {
        for (int i = 0; i < iters; ++i) {
          std::vector<TestPool::Lease> held;
          for (int h = 0; h < hold; ++h) {
            held.push_back(pool_->acquire());
            const size_t now = ++out;
            size_t p = peak.load();
            while (now > p && !peak.compare_exchange_weak(p, now)) {}
          }
          out -= held.size();
          held.clear();
        }
      });
    }
    for (auto& t : ts) t.join();
    return peak.load();
  }

 private:
  CountingEvents traits_;
  std::shared_ptr<TestPool> pool_;
};

struct FlagFence {
  std::shared_ptr<std::atomic<bool>> done;
  bool ready() const { return done->load(); }
};
using TestRing = cl::SlotRing<FlagFence>;

// TestSlotRing::concurrent: threads acquiring and releasing slots of one ring while a
// completer thread sets each release's fence `fence_us` later; counts the overlaps of bytes
// handed out with bytes still in use (acquired and not yet fenced).
class RingStress {
 public:
  RingStress(TestRing& ring, int64_t fence_us) : ring_(ring), fence_us_(fence_us) {}

  std::atomic<int64_t> overlaps{0};
  size_t peak_busy = 0;

  // Whether every thread finished within `timeout_s`.
  bool run(int threads, int runs, const std::vector<size_t>& sizes, double timeout_s) {
    std::thread completer([this] { complete_fences(); });
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t) {
      ts.emplace_back([&, this] {
        for (int r = 0; r < runs; ++r) one_run(sizes);
        ++finished_;
      });
    }
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::duration<double>(timeout_s);
    while (finished_.load() < threads && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    const bool all = finished_.load() == threads;
    for (auto& t : ts) t.join();  // they finish: acquire never waits
    {
      std::lock_guard<std::mutex> lock(q_mu_);
      stop_ = true;
    }
    completer.join();
    return all;
  }

 private:
  // One run: a slot per size, then each released with a fence due `fence_us_` later.
  void one_run(const std::vector<size_t>& sizes) {
    std::vector<TestRing::Slot> mine;
    for (size_t sz : sizes) {
      const TestRing::Slot s = ring_.acquire(sz);
      busy(s);
      mine.push_back(s);
    }
    for (const TestRing::Slot& s : mine) {
      auto flag = std::make_shared<std::atomic<bool>>(false);
      ring_.release(s, FlagFence{flag});
      std::lock_guard<std::mutex> lock(q_mu_);
      queue_.push_back({std::chrono::steady_clock::now() + std::chrono::microseconds(fence_us_),
                        {flag, s}});
    }
  }

  void busy(const TestRing::Slot& s) {
    std::lock_guard<std::mutex> lock(busy_mu_);
    auto it = busy_.lower_bound({s.segment, 0});
    for (; it != busy_.end() && it->first.first == s.segment; ++it) {
      const size_t a = it->first.second, b = it->second;
      if (s.offset < b && a < s.offset + s.size) ++overlaps;
    }
    busy_[{s.segment, s.offset}] = s.offset + s.size;
    busy_bytes_ += s.size;
    peak_busy = std::max(peak_busy, busy_bytes_);
  }

  void unbusy(const TestRing::Slot& s) {
    std::lock_guard<std::mutex> lock(busy_mu_);
    busy_.erase({s.segment, s.offset});
    busy_bytes_ -= s.size;
  }

  // The completer thread: sets each fence when it is due, until stopped with none left.
  void complete_fences() {
    std::unique_lock<std::mutex> lock(q_mu_);
    while (true) {
      const auto now = std::chrono::steady_clock::now();
      while (!queue_.empty() && queue_.front().first <= now) {
        unbusy(queue_.front().second.second);  // before the flag: the ring may reuse it now
        queue_.front().second.first->store(true);
        queue_.pop_front();
      }
      if (stop_ && queue_.empty()) break;
      q_cv_.wait_for(lock, std::chrono::microseconds(100));
    }
  }

  TestRing& ring_;
  const int64_t fence_us_;
  std::atomic<int> finished_{0};
  std::mutex busy_mu_;
  // Bytes in use from the user's side: from acquire until the fence completed.
  std::map<std::pair<size_t, size_t>, size_t> busy_;  // (segment, offset) -> end
  size_t busy_bytes_ = 0;
  std::mutex q_mu_;
  std::condition_variable q_cv_;
  // FIFO: every fence is due `fence_us` after its release.
  std::deque<std::pair<std::chrono::steady_clock::time_point,
                       std::pair<std::shared_ptr<std::atomic<bool>>, TestRing::Slot>>>
      queue_;
  bool stop_ = false;
};

class TestSlotRing {
 public:
  TestSlotRing(size_t align, size_t growth)
      : ring_(std::make_unique<TestRing>(
            [this](size_t bytes) {
              segment_bytes_.push_back(bytes);
              return std::unique_ptr<cl::RingMemory>();
            },
            align, growth)) {}

  void reserve(size_t bytes) { ring_->reserve(bytes); }

  py::dict acquire(size_t size) {
    const TestRing::Slot s = ring_->acquire(size);
    slots_[s.id] = s;
    py::dict d;
    d["id"] = s.id;
    d["segment"] = s.segment;
    d["offset"] = s.offset;
    d["size"] = s.size;
    return d;
  }

  // Release slot `id`, reusable once fence `fence` completes (fence < 0: at once).
  void release(uint64_t id, int64_t fence) {
    auto it = slots_.find(id);
    if (it == slots_.end()) throw std::runtime_error("unknown slot id");
    std::optional<FlagFence> f;
    if (fence >= 0) {
      auto& flag = fences_[fence];
      if (!flag) flag = std::make_shared<std::atomic<bool>>(false);
      f = FlagFence{flag};
    }
    ring_->release(it->second, std::move(f));
    slots_.erase(it);
  }

  void complete(int64_t fence) {
    auto& flag = fences_[fence];
    if (!flag) flag = std::make_shared<std::atomic<bool>>(false);
    flag->store(true);
  }

  void reap() { ring_->reap(); }

  py::dict stats() const {
    const TestRing::Stats st = ring_->stats();
    py::dict d;
    d["segments"] = st.segments;
    d["capacity"] = st.capacity;
    d["in_use"] = st.in_use;
    d["live"] = st.live;
    d["released"] = st.released;
    d["acquired_total"] = st.acquired_total;
    d["reclaimed_total"] = st.reclaimed_total;
    d["segment_bytes"] = segment_bytes_;
    return d;
  }

  // Concurrent runs: `threads` threads each do `runs` runs; a run acquires one slot per
  // entry of `sizes` (a Store), then releases each with a fence that a completer thread sets
  // `fence_us` later (the copy reading it). The ring must never hand out bytes whose fence
  // has not completed, and acquire must never block. Returns the ring stats and the number
  // of overlaps seen (must be 0) and whether every thread finished within `timeout_s`.
  py::dict concurrent(int threads, int runs, std::vector<size_t> sizes, int64_t fence_us,
                      double timeout_s) {
    RingStress stress(*ring_, fence_us);
    {
      py::gil_scoped_release nogil;
      const bool all = stress.run(threads, runs, sizes, timeout_s);
      ring_->reap();
      finished_in_time_ = all;
    }
    py::dict d = stats();
    d["overlaps"] = stress.overlaps.load();
    d["peak_busy"] = stress.peak_busy;  // most bytes acquired and not yet fenced, at one time
    d["finished_in_time"] = finished_in_time_;
    return d;
  }

 private:
  std::vector<size_t> segment_bytes_;
  std::unique_ptr<TestRing> ring_;
  std::map<uint64_t, TestRing::Slot> slots_;
  std::map<int64_t, std::shared_ptr<std::atomic<bool>>> fences_;
  bool finished_in_time_ = false;
};

// `groups[i]` (empty: all "") is weight i's group (its data file); a group named in
// `forget_before[i]` is forgotten before weight i is placed (its slab went).
py::dict pack_weights(const std::vector<size_t>& sizes, const std::vector<std::string>& groups,
                      const std::vector<std::string>& forget_before) {
  cl::WeightPacker p;
  py::list places;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i < forget_before.size() && !forget_before[i].empty()) p.forget(forget_before[i]);
    const cl::WeightPacker::Placement pl = p.place(sizes[i], i < groups.size() ? groups[i] : "");
    py::dict d;
    d["kind"] = pl.kind == cl::WeightPacker::Kind::kOwn     ? "own"
                : pl.kind == cl::WeightPacker::Kind::kChunk ? "chunk"
                                                            : "slab";
    d["own_block"] = pl.own_block();
    d["block_bytes"] = pl.block_bytes;
    d["block"] = pl.block;
    d["offset"] = pl.offset;
    places.append(d);
  }
  py::dict d;
  d["reserved"] = p.reserved();
  d["payload"] = p.payload();
  d["chunks"] = p.chunks();
  d["slabs"] = p.slabs();
  d["placements"] = places;
  return d;
}

// RunRecords (run_records.h) with simulated threads: each call names its thread and
// kernel (0: none); a thread ends when the test says so. Records are named by integers;
// calls return what they released as {"stored": [names], "loads": [names]}, sorted.
class TestRunRecords {
 public:
  struct Stored {
    ho::Owner owner;
    int64_t name = 0;
    int64_t tag = 0;
  };
  struct Load {
    ho::Owner owner;
    int64_t name = 0;
    std::vector<int64_t>* abandoned = nullptr;
    void abandon() { abandoned->push_back(name); }
  };
  using Records = ho::RunRecords<Stored, Load>;

  void end_thread(uint64_t thread) { threads_.ended.push_back(thread); }

  // A Compute's entry (Engine::enter_run): `per_iteration` for an op in a Loop/Scan body.
  py::dict enter(uintptr_t kernel, uint64_t thread, bool per_iteration) {
    Records::Released r;
    records_.enter(on(thread, kernel), &r, per_iteration);
    return released(r);
  }

  py::dict put_stored(uint64_t key, int64_t name, int64_t tag, uint64_t thread,
                      uintptr_t kernel, uintptr_t creator) {
    Records::Released r;
    auto rec = std::make_shared<Stored>();
    rec->name = name;
    rec->tag = tag;
    records_.put_stored(key, rec, on(thread, kernel), &r, address(creator));
    return released(r);
  }

  // (name of the record or None, released); take: removed as well.
  py::tuple find_stored(uint64_t key, int64_t tag, uint64_t thread, uintptr_t kernel,
                        bool take) {
    Records::Released r;
    auto accept = [tag](const Stored& s) { return s.tag == tag; };
    const void* k = on(thread, kernel);
    std::shared_ptr<Stored> rec = take ? records_.take_stored(key, k, accept, &r)
                                       : records_.find_stored(key, k, accept, &r);
    return py::make_tuple(rec ? py::cast(rec->name) : py::none(), released(r));
  }

  py::tuple move_stored(uint64_t key, uint64_t to, int64_t tag, uint64_t thread,
                        uintptr_t kernel) {
    Records::Released r;
    auto accept = [tag](const Stored& s) { return s.tag == tag; };
    std::shared_ptr<Stored> rec = records_.move_stored(key, to, on(thread, kernel), accept, &r);
    return py::make_tuple(rec ? py::cast(rec->name) : py::none(), released(r));
  }

  py::dict put_load(uintptr_t dst, int64_t name, uint64_t thread, uintptr_t kernel,
                    uintptr_t creator) {
    Records::Released r;
    Load load;
    load.name = name;
    load.abandoned = &abandoned_;
    records_.put_load(address(dst), std::move(load), on(thread, kernel), &r, address(creator));
    return released(r);
  }

  py::tuple take_load(uintptr_t dst, uint64_t thread, uintptr_t kernel) {
    Records::Released r;
    std::optional<Load> load = records_.take_load(address(dst), on(thread, kernel), &r);
    return py::make_tuple(load ? py::cast(load->name) : py::none(), released(r));
  }

  py::dict drop_load(uintptr_t dst) {
    return releasing([&](Records::Released* r) { records_.drop_load(address(dst), r); });
  }

  py::dict clear() {
    return releasing([&](Records::Released* r) { records_.clear(r); });
  }

  size_t seen() { return records_.seen_count(); }

  py::dict forget(uintptr_t kernel) {
    return releasing([&](Records::Released* r) { records_.forget(address(kernel), r); });
  }

  py::dict counts() {
    py::dict d;
    d["stored"] = records_.stored_count();
    d["loads"] = records_.load_count();
    d["abandoned"] = abandoned_;
    return d;
  }

 private:
  struct SimThreads final : ho::ThreadSource {
    uint64_t now = 0;
    uint64_t epochs = 0;
    std::vector<uint64_t> ended;
    uint64_t current() override { return now; }
    uint64_t next_epoch() override { return ++epochs; }
    size_t ended_count() override { return ended.size(); }
    size_t ended_since(size_t seen, std::vector<uint64_t>* out) override {
      out->insert(out->end(), ended.begin() + static_cast<std::ptrdiff_t>(seen), ended.end());
      return ended.size();
    }
  };

  static const void* address(uintptr_t a) { return reinterpret_cast<const void*>(a); }
  const void* on(uint64_t thread, uintptr_t kernel) {
    threads_.now = thread;
    return address(kernel);
  }
  // What the call `f(&released)` released.
  template <typename F>
  static py::dict releasing(F&& f) {
    Records::Released r;
    f(&r);
    return released(r);
  }
  static py::dict released(const Records::Released& r) {
    std::vector<int64_t> stored, loads;
    for (const auto& s : r.stored) stored.push_back(s->name);
    for (const auto& l : r.loads) loads.push_back(l.name);
    std::sort(stored.begin(), stored.end());  // (map order is not the test's business)
    std::sort(loads.begin(), loads.end());
    py::dict d;
    d["stored"] = stored;
    d["loads"] = loads;
    return d;
  }

  SimThreads threads_;  // (declared before records_, which reads it when constructed)
  std::vector<int64_t> abandoned_;
  Records records_{threads_};
};

}  // namespace

// Over 60 lines: the module's table of bindings (no logic to split out).
PYBIND11_MODULE(_ops_testing, m) {
  m.doc() = "ho-onnx testing module: fault hooks and harnesses (testing builds only)";
  m.def("set_debug", &set_debug,
        "Fault hooks, each 0 unless named (set_debug() resets all): delay_us (spin/sleep "
        "before every transfer), poison (fill Prefetch outputs, and on CUDA the staging "
        "buffers after use, with 0xFF), skip_wait (CPU: Wait neither waits nor copies; CUDA: "
        "= skip_wait_event). CUDA only, one per ordering edge (docs/cuda.md): "
        "skip_staging_fence (a), skip_detach_wait (b), skip_wait_event (c), "
        "skip_store_start (d); compute_delay_us (spin on the compute stream at each "
        "Prefetch and before each Wait's copy).");
  py::class_<TestLease>(m, "EventLease")
      .def_property_readonly("id", &TestLease::id)
      .def("release", &TestLease::release);
  py::class_<TestEventPool>(m, "EventPool")
      .def(py::init<>())
      .def("acquire", &TestEventPool::acquire)
      .def("prewarm", &TestEventPool::prewarm)
      .def("created", &TestEventPool::created)
      .def("free_count", &TestEventPool::free_count)
      .def("outstanding", &TestEventPool::outstanding)
      .def("destroyed", &TestEventPool::destroyed)
      .def("close", &TestEventPool::close)
      .def("stress", &TestEventPool::stress, py::arg("threads"), py::arg("iters"),
           py::arg("hold"));
  py::class_<TestSlotRing>(m, "SlotRing")
      .def(py::init<size_t, size_t>(), py::arg("align") = ho::cuda_logic::kRingAlign,
           py::arg("growth") = ho::cuda_logic::kRingGrowth)
      .def("reserve", &TestSlotRing::reserve)
      .def("acquire", &TestSlotRing::acquire)
      .def("release", &TestSlotRing::release, py::arg("id"), py::arg("fence") = -1)
      .def("complete", &TestSlotRing::complete)
      .def("reap", &TestSlotRing::reap)
      .def("stats", &TestSlotRing::stats)
      .def("concurrent", &TestSlotRing::concurrent, py::arg("threads"), py::arg("runs"),
           py::arg("sizes"), py::arg("fence_us"), py::arg("timeout_s") = 30.0);
  py::class_<TestRunRecords>(m, "RunRecords")
      .def(py::init<>())
      .def("end_thread", &TestRunRecords::end_thread)
      .def("enter", &TestRunRecords::enter, py::arg("kernel"), py::arg("thread") = 1,
           py::arg("per_iteration") = false)
      .def("put_stored", &TestRunRecords::put_stored, py::arg("key"), py::arg("name"),
           py::arg("tag") = 0, py::arg("thread") = 1, py::arg("kernel") = 0,
           py::arg("creator") = 0)
      .def("find_stored", &TestRunRecords::find_stored, py::arg("key"), py::arg("tag") = 0,
           py::arg("thread") = 1, py::arg("kernel") = 0, py::arg("take") = false)
      .def("move_stored", &TestRunRecords::move_stored, py::arg("key"), py::arg("to"),
           py::arg("tag") = 0, py::arg("thread") = 1, py::arg("kernel") = 0)
      .def("put_load", &TestRunRecords::put_load, py::arg("dst"), py::arg("name"),
           py::arg("thread") = 1, py::arg("kernel") = 0, py::arg("creator") = 0)
      .def("take_load", &TestRunRecords::take_load, py::arg("dst"), py::arg("thread") = 1,
           py::arg("kernel") = 0)
      .def("drop_load", &TestRunRecords::drop_load)
      .def("clear", &TestRunRecords::clear)
      .def("forget", &TestRunRecords::forget)
      .def("seen", [](TestRunRecords& t) { return t.seen(); })
      .def("counts", &TestRunRecords::counts);
  m.def("pool_size_class", &ho::pool_size_class,
        "The size class the host pool rounds a request of `size` bytes up to.");
  m.def("ring_capacity", &ho::cuda_logic::ring_capacity,
        "First ring segment for a plan storing `host_bytes` bytes of activations per run.");
  m.def("pack_weights", &pack_weights, py::arg("sizes"),
        py::arg("groups") = std::vector<std::string>(),
        py::arg("forget_before") = std::vector<std::string>(),
        "Where the pinned weight store puts weights of the given sizes and groups (WeightPacker).");
}
