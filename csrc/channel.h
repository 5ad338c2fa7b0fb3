// A transfer channel: worker thread(s) draining a FIFO queue of jobs, each with a
// completion that waiters block on and that carries the job's error, if any. The load and
// store channels have one worker; the disk channel has a few (jobs still start in FIFO order).
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

namespace ho {

class Completion {
 public:
  void finish(std::string error = {});
  // Blocks until finished; returns the job's error ("" on success).
  std::string wait();

  // Cancellation of a job that writes into memory it does not own (ORT's buffers): the job
  // holds the write lock while it writes and skips the write once cancelled, so after
  // cancel() returns nothing is written any more. Used when nobody will wait for the job.
  // Writers share the lock (the parts of one disk transfer are written by several threads).
  bool begin_write();  // false: cancelled, do not write
  void end_write();
  void cancel();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::string error_;
  std::shared_mutex write_mu_;
  bool cancelled_ = false;
};
using CompletionPtr = std::shared_ptr<Completion>;

class Channel {
 public:
  explicit Channel(std::string name, int workers = 1);
  ~Channel();  // drops the jobs still queued (finished as cancelled), joins the worker
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  // Queue `fn`; `done` (may be null) is finished after it ran (with the message of what it
  // threw).
  void submit(std::function<void()> fn, CompletionPtr done);

 private:
  struct Job {
    std::function<void()> fn;
    CompletionPtr done;
  };
  void run();

  std::string name_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> queue_;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace ho
