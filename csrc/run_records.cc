// The process's threads as run_records.h sees them: each thread that calls into an engine
// gets an identity (never reused, unlike its std::thread::id), and its end is recorded so
// that engines release what its runs left.
#include "run_records.h"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

namespace ho {

namespace {

std::atomic<uint64_t> g_next_epoch{1};  // unique in the process
std::atomic<uint64_t> g_next_thread{1};

// Threads that ended (their identities, in order). Never freed (8 bytes per thread that
// ever ran a cache op and ended).
std::mutex g_ended_mu;
std::vector<uint64_t>* g_ended = new std::vector<uint64_t>();
std::atomic<size_t> g_ended_count{0};

struct ThreadMark {
  const uint64_t uid = g_next_thread.fetch_add(1);
  ~ThreadMark() {
    std::lock_guard<std::mutex> lock(g_ended_mu);
    g_ended->push_back(uid);
    g_ended_count.store(g_ended->size(), std::memory_order_release);
  }
};

class ProcessThreads final : public ThreadSource {
 public:
  uint64_t current() override {
    thread_local ThreadMark mark;
    return mark.uid;
  }
  uint64_t next_epoch() override { return g_next_epoch.fetch_add(1); }
  size_t ended_count() override { return g_ended_count.load(std::memory_order_acquire); }
  size_t ended_since(size_t seen, std::vector<uint64_t>* out) override {
    std::lock_guard<std::mutex> lock(g_ended_mu);
    out->insert(out->end(), g_ended->begin() + static_cast<std::ptrdiff_t>(seen), g_ended->end());
    return g_ended->size();
  }
};

}  // namespace

ThreadSource& process_threads() {
  static ProcessThreads* threads = new ProcessThreads();  // never destroyed (thread exits)
  return *threads;
}

}  // namespace ho
