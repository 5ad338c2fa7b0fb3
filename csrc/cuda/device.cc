#include "device.h"

namespace ho::gpu {

std::shared_ptr<Device> shared_device(int device) {
  static std::mutex mu;
  static auto* devices = new std::map<int, std::weak_ptr<Device>>();  // never freed
  std::lock_guard<std::mutex> lock(mu);
  std::weak_ptr<Device>& slot = (*devices)[device];
  std::shared_ptr<Device> d = slot.lock();
  if (!d) {
    d = std::make_shared<Device>(device);
    slot = d;
  }
  return d;
}

}  // namespace ho::gpu
