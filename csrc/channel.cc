#include "channel.h"

#include <exception>
#include <utility>

namespace ho {

void Completion::finish(std::string error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    error_ = std::move(error);
  }
  cv_.notify_all();
}

std::string Completion::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return done_; });
  return error_;
}

bool Completion::begin_write() {
  write_mu_.lock_shared();
  if (cancelled_) {
    write_mu_.unlock_shared();
    return false;
  }
  return true;
}

void Completion::end_write() { write_mu_.unlock_shared(); }

void Completion::cancel() {
  std::unique_lock<std::shared_mutex> lock(write_mu_);
  cancelled_ = true;
}

Channel::Channel(std::string name, int workers) : name_(std::move(name)) {
  if (workers < 1) workers = 1;
  workers_.reserve(static_cast<size_t>(workers));
  for (int i = 0; i < workers; ++i) workers_.emplace_back([this] { run(); });
}

Channel::~Channel() {
  std::deque<Job> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    dropped.swap(queue_);
  }
  cv_.notify_all();
  for (Job& job : dropped) {
    job.fn = nullptr;
    if (job.done) job.done->finish(name_ + " channel: transfer cancelled (engine destroyed)");
  }
  for (std::thread& w : workers_) {
    if (w.joinable()) w.join();
  }
}

void Channel::submit(std::function<void()> fn, CompletionPtr done) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(Job{std::move(fn), std::move(done)});
  }
  cv_.notify_one();
}

void Channel::run() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopped
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    std::string error;
    try {
      job.fn();
    } catch (const std::exception& e) {
      error = name_ + " channel: " + e.what();
    } catch (...) {
      error = name_ + " channel: unknown error in transfer";
    }
    job.fn = nullptr;  // drop captured state before waking the waiters
    if (job.done) job.done->finish(std::move(error));
  }
}

}  // namespace ho
