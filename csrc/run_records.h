// Run-owned records of both engines (docs/design.md, "Runs are told apart without ORT's
// help"): stored tensors (a Store's copy, until its reload) and pending loads (a Prefetch's
// transfer, until its Wait), each owned by the run that made it, so that what a failed run
// left behind is released at the latest when the next run starts on its thread, and a run
// never reaches another run's record made on its own thread.
//
// ORT's custom-op API has no end-of-run callback. A run is the calling thread plus that
// thread's run epoch: ORT runs every node once per run and, with the sequential executor,
// all of a run's kernels on the thread that called Run; so when a cache op (its kernel's
// identity) executes on a thread where it already executed in the current epoch, a new run
// has started there, the epoch advances, and the thread's records of earlier epochs are
// released. Records of threads that ended are released at the next call of any thread.
//
// The engines differ only in keys: the CPU engine keys stored tensors by the id it writes
// into the token (and checks the token's random tag through `accept`), the CUDA engine by
// the token's device address (it never reads device memory on the host). Pending loads are
// keyed by the Prefetch output's address in both. A record found at the key of a new one
// belongs to a failed run (ORT never hands out a live buffer's address twice): replaced.
//
// Header-only and free of globals, so that the logic is unit-tested with simulated threads
// (module.cc: _ops._TestRunRecords); the library's ThreadSource is process_threads().
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace ho {

// Which run a record belongs to: the thread that ran the op and that thread's run epoch,
// the iteration of a Loop/Scan body it was made in (0: the main graph's), and the kernel
// that made it (its session's: released with that kernel, see forget()).
struct Owner {
  uint64_t thread = 0;
  uint64_t epoch = 0;
  uint64_t iteration = 0;
  const void* creator = nullptr;
};

// Where runs come from: the calling thread's identity, the threads that ended (in the
// order they ended), and fresh epoch numbers.
class ThreadSource {
 public:
  virtual ~ThreadSource() = default;
  virtual uint64_t current() = 0;
  virtual uint64_t next_epoch() = 0;
  // How many threads ended so far (cheap: read at every call).
  virtual size_t ended_count() = 0;
  // Appends the threads that ended after the first `seen` of them; returns ended_count().
  virtual size_t ended_since(size_t seen, std::vector<uint64_t>* out) = 0;
};

// The process's threads (run_records.cc): a thread's identity is never reused.
ThreadSource& process_threads();

// Records of types S (stored tensors, held by shared_ptr) and L (pending loads, by value),
// each with a public `Owner owner`; L also has `void abandon()`, called when a load is
// released without its Wait (e.g. to stop a disk read). Thread-safe (its own lock).
template <class S, class L>
class RunRecords {
 public:
  using StoredPtr = std::shared_ptr<S>;

  // What ended or replaced runs left: the caller destroys it after every lock is let go
  // (the records hold pool buffers and staging that take other locks when freed).
  struct Released {
    std::vector<StoredPtr> stored;
    std::vector<L> loads;
  };

  // `on_run_start`: called (under the records' lock: it must not call back) whenever a run
  // starts on some thread.
  explicit RunRecords(ThreadSource& threads, std::function<void()> on_run_start = {})
      : threads_(threads), on_run_start_(std::move(on_run_start)),
        ended_seen_(threads.ended_count()) {}
  RunRecords(const RunRecords&) = delete;
  RunRecords& operator=(const RunRecords&) = delete;

  // Every call below that takes `kernel` enters the calling thread's run first. `kernel` is
  // the cache op's identity, given by exactly one call per Compute (the engines: enter()
  // at its start, Engine::enter_run); null in the calls after it, which belong to the
  // scope that call entered.
  //
  // `per_iteration`: the op is inside a Loop/Scan body (attribute `iteration` = 1), so it
  // executes once per iteration. Such a kernel seen again on the thread starts the next
  // *iteration*, not the next run: the records the body's ops made in earlier iterations
  // (any run's: a failed iteration's, or a failed run's where the main graph has no cache
  // op) are released, the main graph's stay. A main-graph kernel seen again starts the next
  // run as always, which releases the body's records too.
  Owner enter(const void* kernel, Released* out, bool per_iteration = false) {
    std::lock_guard<std::mutex> lock(mu_);
    return enter_locked(kernel, out, per_iteration);
  }

  // Record `rec` under `key`, owned by the caller's run; made by the kernel `creator`.
  void put_stored(uint64_t key, StoredPtr rec, const void* kernel, Released* out,
                  const void* creator = nullptr) {
    std::lock_guard<std::mutex> lock(mu_);
    rec->owner = enter_locked(kernel, out);
    rec->owner.creator = creator;
    StoredPtr& slot = stored_[key];
    if (slot) out->stored.push_back(std::move(slot));  // a failed run's, at a reused key
    slot = std::move(rec);
  }

  // The record under `key` if there is one, `accept(record)` holds and the caller's run may
  // use it; else null. take_stored also removes it.
  template <class Accept>
  StoredPtr find_stored(uint64_t key, const void* kernel, Accept accept, Released* out) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = usable_stored_locked(key, kernel, accept, out);
    return it == stored_.end() ? nullptr : it->second;
  }
  template <class Accept>
  StoredPtr take_stored(uint64_t key, const void* kernel, Accept accept, Released* out) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = usable_stored_locked(key, kernel, accept, out);
    if (it == stored_.end()) return nullptr;
    StoredPtr rec = std::move(it->second);
    stored_.erase(it);
    return rec;
  }

  // find_stored, and the record (when found) then lives under `to` (the CUDA engine's
  // Detach, when ORT gave the token a new buffer); a record there already is a failed
  // run's (released).
  template <class Accept>
  StoredPtr move_stored(uint64_t key, uint64_t to, const void* kernel, Accept accept,
                        Released* out) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = usable_stored_locked(key, kernel, accept, out);
    if (it == stored_.end()) return nullptr;
    StoredPtr rec = it->second;
    if (to != key) {
      stored_.erase(it);
      StoredPtr& slot = stored_[to];
      if (slot) out->stored.push_back(std::move(slot));
      slot = rec;
    }
    return rec;
  }

  // Record the load into `dst`, owned by the caller's run; made by the kernel `creator`.
  void put_load(const void* dst, L load, const void* kernel, Released* out,
                const void* creator = nullptr) {
    std::lock_guard<std::mutex> lock(mu_);
    load.owner = enter_locked(kernel, out);
    load.owner.creator = creator;
    auto it = loads_.find(dst);
    if (it != loads_.end()) {
      release_load_locked(std::move(it->second), out);
      it->second = std::move(load);
    } else {
      loads_.emplace(dst, std::move(load));
    }
  }

  // The load into `dst` if there is one and the caller's run may use it (removed).
  std::optional<L> take_load(const void* dst, const void* kernel, Released* out) {
    std::lock_guard<std::mutex> lock(mu_);
    const Owner me = enter_locked(kernel, out);
    auto it = loads_.find(dst);
    if (it == loads_.end() || !may_use(it->second.owner, me)) return std::nullopt;
    std::optional<L> load(std::move(it->second));
    loads_.erase(it);
    return load;
  }

  // Release a load into `dst` left by a failed run (a new load for that address starts).
  void drop_load(const void* dst, Released* out) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = loads_.find(dst);
    if (it == loads_.end()) return;
    release_load_locked(std::move(it->second), out);
    loads_.erase(it);
  }

  // The kernel `kernel` is destroyed (its session is gone, so no run of it is in progress):
  // what it made is released, and no thread's run remembers it. Without this, a server
  // that makes a session per request kept every failed request's records while another
  // session kept the engine (no kernel of the dead session ever repeats on a thread), and
  // each thread's set of seen kernels grew with every session.
  void forget(const void* kernel, Released* out) {
    if (kernel == nullptr) return;
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& kv : threads_runs_) {
      kv.second.seen.erase(kernel);
      kv.second.body_seen.erase(kernel);
    }
    for (auto it = stored_.begin(); it != stored_.end();) {
      if (it->second->owner.creator == kernel) {
        out->stored.push_back(std::move(it->second));
        it = stored_.erase(it);
      } else {
        ++it;
      }
    }
    for (auto it = loads_.begin(); it != loads_.end();) {
      if (it->second.owner.creator == kernel) {
        release_load_locked(std::move(it->second), out);
        it = loads_.erase(it);
      } else {
        ++it;
      }
    }
  }

  // Kernels the threads' current runs remember (bounded by the live sessions' kernels).
  size_t seen_count() {
    std::lock_guard<std::mutex> lock(mu_);
    size_t n = 0;
    for (const auto& kv : threads_runs_) {
      n += kv.second.seen.size() + kv.second.body_seen.size();
    }
    return n;
  }

  void clear(Released* out) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& kv : stored_) out->stored.push_back(std::move(kv.second));
    for (auto& kv : loads_) release_load_locked(std::move(kv.second), out);
    stored_.clear();
    loads_.clear();
    threads_runs_.clear();
  }

  size_t stored_count() {
    std::lock_guard<std::mutex> lock(mu_);
    return stored_.size();
  }
  size_t load_count() {
    std::lock_guard<std::mutex> lock(mu_);
    return loads_.size();
  }

  // A record made on the caller's thread must come from its current run, and one a body's
  // op made from its current iteration. Records made on other threads are accepted
  // (ORT_PARALLEL runs one run's nodes on several threads); they are released with their
  // own thread's next run.
  static bool may_use(const Owner& rec, const Owner& me) {
    return rec.thread != me.thread ||
           (rec.epoch == me.epoch && (rec.iteration == 0 || rec.iteration == me.iteration));
  }

 private:
  struct ThreadRun {
    uint64_t epoch = 0;
    std::unordered_set<const void*> seen;  // main-graph kernels of this run
    uint64_t iteration = 0;                // the body's current iteration (0: none yet)
    std::unordered_set<const void*> body_seen;  // body kernels of that iteration
    uint64_t scope = 0;  // what the last kernel entered: its iteration, 0 for the main graph
  };

  Owner enter_locked(const void* kernel, Released* out, bool per_iteration = false) {
    const uint64_t tid = threads_.current();
    if (threads_.ended_count() != ended_seen_) reap_ended_locked(out);
    ThreadRun& tr = threads_runs_[tid];
    const bool main_repeats =
        kernel != nullptr && !per_iteration && !tr.seen.insert(kernel).second;
    if (tr.epoch == 0 || main_repeats) {
      if (on_run_start_) on_run_start_();
      const uint64_t old = tr.epoch;
      tr.epoch = threads_.next_epoch();
      tr.seen.clear();
      tr.body_seen.clear();
      tr.iteration = 0;
      if (kernel != nullptr && !per_iteration) tr.seen.insert(kernel);
      if (old != 0) release_runs_locked(tid, old, out);
    }
    if (kernel != nullptr && per_iteration) {
      if (tr.iteration == 0 || !tr.body_seen.insert(kernel).second) {
        tr.iteration = threads_.next_epoch();
        tr.body_seen.clear();
        tr.body_seen.insert(kernel);
        release_iterations_locked(tid, out);
      }
    }
    if (kernel != nullptr) tr.scope = per_iteration ? tr.iteration : 0;
    return Owner{tid, tr.epoch, tr.scope};
  }

  template <class Accept>
  typename std::unordered_map<uint64_t, StoredPtr>::iterator usable_stored_locked(
      uint64_t key, const void* kernel, Accept& accept, Released* out) {
    const Owner me = enter_locked(kernel, out);
    auto it = stored_.find(key);
    if (it == stored_.end() || !accept(*it->second) || !may_use(it->second->owner, me)) {
      return stored_.end();
    }
    return it;
  }

  // Records of threads that ended belong to runs that are over.
  void reap_ended_locked(Released* out) {
    std::vector<uint64_t> ended;
    ended_seen_ = threads_.ended_since(ended_seen_, &ended);
    for (uint64_t tid : ended) {
      if (threads_runs_.erase(tid) != 0) release_runs_locked(tid, UINT64_MAX, out);
    }
  }

  // Every record of thread `tid` up to run epoch `epoch`.
  void release_runs_locked(uint64_t tid, uint64_t epoch, Released* out) {
    release_where_locked([&](const Owner& o) { return o.thread == tid && o.epoch <= epoch; },
                         out);
  }

  // Every record a body's op made on thread `tid` before its current iteration.
  void release_iterations_locked(uint64_t tid, Released* out) {
    const uint64_t now = threads_runs_[tid].iteration;
    release_where_locked(
        [&](const Owner& o) { return o.thread == tid && o.iteration != 0 && o.iteration < now; },
        out);
  }

  template <class Ended>
  void release_where_locked(Ended ended, Released* out) {
    for (auto it = stored_.begin(); it != stored_.end();) {
      if (ended(it->second->owner)) {
        out->stored.push_back(std::move(it->second));
        it = stored_.erase(it);
      } else {
        ++it;
      }
    }
    for (auto it = loads_.begin(); it != loads_.end();) {
      if (ended(it->second.owner)) {
        release_load_locked(std::move(it->second), out);
        it = loads_.erase(it);
      } else {
        ++it;
      }
    }
  }

  static void release_load_locked(L&& load, Released* out) {
    load.abandon();
    out->loads.push_back(std::move(load));
  }

  ThreadSource& threads_;
  std::mutex mu_;
  std::function<void()> on_run_start_;
  size_t ended_seen_;
  std::unordered_map<uint64_t, ThreadRun> threads_runs_;
  std::unordered_map<uint64_t, StoredPtr> stored_;
  std::unordered_map<const void*, L> loads_;
};

}  // namespace ho
