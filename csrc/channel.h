// A transfer channel: one worker thread draining a FIFO queue of jobs, each with a
// completion that waiters block on and that carries the job's error, if any.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace ho {

class Completion {
 public:
  void finish(std::string error = {});
  // Blocks until finished; returns the job's error ("" on success).
  std::string wait();

  // Cancellation of a job that writes into memory it does not own (ORT's buffers): the job
  // holds the write lock while it writes and skips the write once cancelled, so after
  // cancel() returns nothing is written any more. Used when nobody will wait for the job.
  bool begin_write();  // false: cancelled, do not write
  void end_write();
  void cancel();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::string error_;
  std::mutex write_mu_;
  bool cancelled_ = false;
};
using CompletionPtr = std::shared_ptr<Completion>;

class Channel {
 public:
  explicit Channel(std::string name);
  ~Channel();  // drops the jobs still queued (finished as cancelled), joins the worker
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  // Queue `fn`; `done` is finished after it ran (with the message of what it threw).
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
  std::thread worker_;
};

}  // namespace ho
