// A cache of weak references (the host stores of weights, the disk tier's open files): an
// entry lives while some caller holds its value, so a value goes with its last user; the
// expired entries are dropped in amortized sweeps.
#pragma once

#include <cstddef>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <string>

namespace ho {

template <typename T>
class WeakCache {
 public:
  // The value held under `key`, or `make()`'s (a std::shared_ptr<T>) stored there when no
  // caller holds one any more. `make` runs under the cache's lock: one value per key.
  template <typename Make>
  std::shared_ptr<T> get(const std::string& key, Make&& make) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = map_.find(key);
    if (it != map_.end()) {
      if (std::shared_ptr<T> held = it->second.lock()) return held;
    }
    // Expired entries go once the map has doubled (plus 64) since the last sweep (a model's
    // session creation adds each of its weights once).
    if (map_.size() >= 2 * swept_ + 64) {
      for (auto e = map_.begin(); e != map_.end();) {
        e = e->second.expired() ? map_.erase(e) : std::next(e);
      }
      swept_ = map_.size();
    }
    std::shared_ptr<T> made = make();
    map_[key] = made;  // (replaces an expired entry)
    return made;
  }

 private:
  std::mutex mu_;
  std::map<std::string, std::weak_ptr<T>> map_;
  size_t swept_ = 0;  // entries after the last sweep
};

}  // namespace ho
