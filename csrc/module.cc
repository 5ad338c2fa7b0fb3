// The pybind11 module ho_onnx._ops: build facts, counters and test hooks. The same shared
// library is the ORT custom-op library (ops.cc: RegisterCustomOps).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common.h"
#include "cuda/host_logic.h"
#if HO_ONNX_WITH_CUDA
#include "cuda/cuda_api.h"
#include "cuda/probe.h"
#endif

namespace py = pybind11;

#ifndef HO_ONNX_VERSION
#define HO_ONNX_VERSION "0.0.0"
#endif
#ifndef HO_ONNX_CXX_COMPILER
#define HO_ONNX_CXX_COMPILER "unknown"
#endif

namespace {

py::dict build_info() {
  py::dict d;
  d["version"] = HO_ONNX_VERSION;
  d["ort_api_version"] = ORT_API_VERSION;
#if HO_ONNX_WITH_CUDA
  d["cuda_compiled"] = true;
#else
  d["cuda_compiled"] = false;
#endif
  d["cxx_compiler"] = HO_ONNX_CXX_COMPILER;
  py::list types;
  for (const ho::ElemType* t = ho::elem_types(); t->bits != 0; ++t) types.append(t->name);
  d["element_types"] = types;
  return d;
}

int cuda_device_count() {
#if HO_ONNX_WITH_CUDA
  std::string err;
  return ho_cuda_device_count(&err);
#else
  return 0;
#endif
}

py::dict counters() {
  const ho::Counters& c = ho::counters();
  py::dict d;
  d["bytes_loaded"] = c.bytes_loaded.load();
  d["bytes_stored"] = c.bytes_stored.load();
  d["prefetches"] = c.prefetches.load();
  d["stores"] = c.stores.load();
  d["waits"] = c.waits.load();
  d["wait_ns"] = c.wait_ns.load();
  d["alias_copies"] = c.alias_copies.load();
  d["bytes_read_disk"] = c.bytes_read_disk.load();
  d["disk_read_ns"] = c.disk_read_ns.load();
  d["disk_direct_reads"] = c.disk_direct_reads.load();
  d["disk_buffered_reads"] = c.disk_buffered_reads.load();
  d["host_store_bytes"] = c.host_store_bytes.load();
  d["host_pool_bytes_in_use"] = c.host_pool_bytes_in_use.load();
  d["host_pool_bytes_reserved"] = c.host_pool_bytes_reserved.load();
  d["engines_alive"] = c.engines_alive.load();
  d["pinned_bytes"] = c.pinned_bytes.load();
  d["device_staging_bytes"] = c.device_staging_bytes.load();
  d["pinned_allocs"] = c.pinned_allocs.load();
  d["cuda_events_created"] = c.cuda_events_created.load();
  d["ring_segments"] = c.ring_segments.load();
  d["registrations"] = c.registrations.load();
  d["cuda_registrations"] = c.cuda_registrations.load();
  return d;
}

void reset_counters() {
  ho::Counters& c = ho::counters();
  c.bytes_loaded = 0;
  c.bytes_stored = 0;
  c.prefetches = 0;
  c.stores = 0;
  c.waits = 0;
  c.wait_ns = 0;
  c.alias_copies = 0;
  c.bytes_read_disk = 0;
  c.disk_read_ns = 0;
  c.disk_direct_reads = 0;
  c.disk_buffered_reads = 0;
}

void set_debug(int64_t delay_us, bool poison, bool skip_wait, bool skip_order,
               int64_t compute_delay_us, bool cuda_timing) {
  ho::Debug& d = ho::debug();
  d.delay_us = delay_us < 0 ? 0 : delay_us;
  d.poison = poison;
  d.skip_wait = skip_wait;
  d.skip_order = skip_order;
  d.compute_delay_us = compute_delay_us < 0 ? 0 : compute_delay_us;
  d.cuda_timing = cuda_timing;
}

#if HO_ONNX_WITH_CUDA
// A CUDA failure raises RuntimeError with the CUDA error's text.
template <typename F>
auto cuda_call(F&& f) {
  try {
    return f();
  } catch (const ho::Error& e) {
    throw std::runtime_error(e.what());
  }
}
#endif

#if !HO_ONNX_WITH_CUDA
[[noreturn]] void no_cuda(const char* what) {
  throw std::runtime_error(std::string(what) + ": ho_onnx was built without CUDA");
}
#endif

py::tuple cuda_mem_info(int device) {
#if HO_ONNX_WITH_CUDA
  const ho::CudaMemInfo m = cuda_call([&] { return ho::cuda_mem_info(device); });
  return py::make_tuple(m.free_bytes, m.total_bytes);
#else
  (void)device;
  no_cuda("cuda_mem_info");
#endif
}

py::dict cuda_calibrate(size_t bytes, int device, int repeats) {
#if HO_ONNX_WITH_CUDA
  ho::CudaCalibration c;
  {
    py::gil_scoped_release nogil;
    c = cuda_call([&] { return ho::cuda_calibrate(bytes, device, repeats); });
  }
  py::dict d;
  d["h2d_bw"] = c.h2d_bw;
  d["d2h_bw"] = c.d2h_bw;
  d["bytes"] = c.bytes;
  d["device"] = c.device;
  d["device_name"] = c.device_name;
  return d;
#else
  (void)bytes;
  (void)device;
  (void)repeats;
  no_cuda("cuda_calibrate");
#endif
}

py::dict cuda_transfer_times(bool reset) {
#if HO_ONNX_WITH_CUDA
  ho::CudaTransferTimes t;
  {
    py::gil_scoped_release nogil;
    t = cuda_call([&] { return ho::cuda_transfer_times(reset); });
  }
  py::dict d;
  d["h2d_bytes"] = t.h2d_bytes;
  d["h2d_s"] = t.h2d_s;
  d["h2d_copies"] = t.h2d_copies;
  d["d2h_bytes"] = t.d2h_bytes;
  d["d2h_s"] = t.d2h_s;
  d["d2h_copies"] = t.d2h_copies;
  return d;
#else
  (void)reset;
  no_cuda("cuda_transfer_times");
#endif
}

// ---------------------------------------------------------------------------------------
// Test hooks of the CUDA engine's host-side logic (csrc/cuda/host_logic.h), compiled in
// every build. The event is the only stand-in: a number from a counter, and a fence is a
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
    std::atomic<int64_t> overlaps{0};
    std::atomic<int> finished{0};
    std::mutex busy_mu;
    // Bytes in use from the user's side: from acquire until the fence completed.
    std::map<std::pair<size_t, size_t>, size_t> busy;  // (segment, offset) -> end
    std::mutex q_mu;
    std::condition_variable q_cv;
    // FIFO: every fence is due `fence_us` after its release.
    std::deque<std::pair<std::chrono::steady_clock::time_point,
                         std::pair<std::shared_ptr<std::atomic<bool>>, TestRing::Slot>>>
        queue;
    size_t busy_bytes = 0, peak_busy = 0;
    bool stop = false;
    auto unbusy = [&](const TestRing::Slot& s) {
      std::lock_guard<std::mutex> lock(busy_mu);
      busy.erase({s.segment, s.offset});
      busy_bytes -= s.size;
    };
    {
      py::gil_scoped_release nogil;
      std::thread completer([&] {
        std::unique_lock<std::mutex> lock(q_mu);
        while (true) {
          const auto now = std::chrono::steady_clock::now();
          while (!queue.empty() && queue.front().first <= now) {
            unbusy(queue.front().second.second);  // before the flag: the ring may reuse it now
            queue.front().second.first->store(true);
            queue.pop_front();
          }
          if (stop && queue.empty()) break;
          q_cv.wait_for(lock, std::chrono::microseconds(100));
        }
      });
      std::vector<std::thread> ts;
      for (int t = 0; t < threads; ++t) {
        ts.emplace_back([&] {
          for (int r = 0; r < runs; ++r) {
            std::vector<TestRing::Slot> mine;
            for (size_t sz : sizes) {
              const TestRing::Slot s = ring_->acquire(sz);
              {
                std::lock_guard<std::mutex> lock(busy_mu);
                auto it = busy.lower_bound({s.segment, 0});
                for (; it != busy.end() && it->first.first == s.segment; ++it) {
                  const size_t a = it->first.second, b = it->second;
                  if (s.offset < b && a < s.offset + s.size) ++overlaps;
                }
                busy[{s.segment, s.offset}] = s.offset + s.size;
                busy_bytes += s.size;
                peak_busy = std::max(peak_busy, busy_bytes);
              }
              mine.push_back(s);
            }
            for (const TestRing::Slot& s : mine) {
              auto flag = std::make_shared<std::atomic<bool>>(false);
              ring_->release(s, FlagFence{flag});
              std::lock_guard<std::mutex> lock(q_mu);
              queue.push_back({std::chrono::steady_clock::now() +
                                   std::chrono::microseconds(fence_us),
                               {flag, s}});
            }
          }
          ++finished;
        });
      }
      const auto deadline = std::chrono::steady_clock::now() +
                            std::chrono::duration<double>(timeout_s);
      while (finished.load() < threads && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      const bool all = finished.load() == threads;
      for (auto& t : ts) t.join();  // they finish: acquire never waits
      {
        std::lock_guard<std::mutex> lock(q_mu);
        stop = true;
      }
      completer.join();
      ring_->reap();
      finished_in_time_ = all;
    }
    py::dict d = stats();
    d["overlaps"] = overlaps.load();
    d["peak_busy"] = peak_busy;  // most bytes acquired and not yet fenced, at one time
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

py::dict pack_weights(const std::vector<size_t>& sizes) {
  cl::WeightPacker p;
  py::list places;
  for (size_t n : sizes) {
    const cl::WeightPacker::Placement pl = p.place(n);
    py::dict d;
    d["own_block"] = pl.own_block;
    d["block_bytes"] = pl.block_bytes;
    d["chunk"] = pl.chunk;
    d["offset"] = pl.offset;
    places.append(d);
  }
  py::dict d;
  d["reserved"] = p.reserved();
  d["payload"] = p.payload();
  d["chunks"] = p.chunks();
  d["placements"] = places;
  return d;
}

}  // namespace

PYBIND11_MODULE(_ops, m) {
  m.doc() = "ho-onnx native library: ORT custom ops (ai.hyperoffload) and their counters";
  m.attr("__version__") = HO_ONNX_VERSION;
  m.def("build_info", &build_info,
        "Build facts: version, ort_api_version, cuda_compiled, cxx_compiler, element_types.");
  m.def("cuda_device_count", &cuda_device_count,
        "CUDA devices visible (0 without a CUDA build, a driver or a device).");
  m.def("counters", &counters, "Process-wide transfer and memory counters.");
  m.def("reset_counters", &reset_counters,
        "Reset the monotonic counters (bytes, counts, wait time); gauges are kept.");
  m.def("set_debug", &set_debug, py::arg("delay_us") = 0, py::arg("poison") = false,
        py::arg("skip_wait") = false, py::arg("skip_order") = false,
        py::arg("compute_delay_us") = 0, py::arg("cuda_timing") = false,
        "Test hooks: delay every transfer, poison Prefetch outputs, make Wait/Detach not wait; "
        "CUDA only: skip_order (copies not ordered after the compute stream, Detach not "
        "ordered after its store), compute_delay_us (spin on the compute stream at each "
        "Prefetch), cuda_timing (time every copy: cuda_transfer_times).");
  m.def("cuda_mem_info", &cuda_mem_info, py::arg("device") = 0,
        "(free, total) bytes of a CUDA device (cudaMemGetInfo: every allocation on the "
        "device, ONNX Runtime's included). RuntimeError without CUDA.");
  m.def("cuda_calibrate", &cuda_calibrate, py::arg("bytes") = size_t{256} << 20,
        py::arg("device") = 0, py::arg("repeats") = 5,
        "Pinned host <-> device copy rates (bytes/s, best of `repeats` single "
        "cudaMemcpyAsync of `bytes`): dict(h2d_bw, d2h_bw, bytes, device, device_name).");
  m.def("cuda_transfer_times", &cuda_transfer_times, py::arg("reset") = true,
        "Bytes and GPU seconds of the engine's copies timed while set_debug(cuda_timing=True).");

  py::class_<TestLease>(m, "_test_EventLease")
      .def_property_readonly("id", &TestLease::id)
      .def("release", &TestLease::release);
  py::class_<TestEventPool>(m, "_test_EventPool")
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
  py::class_<TestSlotRing>(m, "_test_SlotRing")
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
  m.def("_test_ring_capacity", &ho::cuda_logic::ring_capacity,
        "First ring segment for a plan storing `host_bytes` bytes of activations per run.");
  m.def("_test_pack_weights", &pack_weights,
        "Where the pinned weight store puts weights of the given sizes (WeightPacker).");
}
