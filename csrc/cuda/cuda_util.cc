#include "cuda_util.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

namespace ho {
namespace cuda {

void check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  const char* name = cudaGetErrorName(e);
  const char* text = cudaGetErrorString(e);
  // A launch or API error that is not sticky must not be reported again by a later call.
  (void)cudaGetLastError();
  fail(ORT_FAIL, std::string("CUDA error in ") + what + ": " + (name ? name : "?") + ": " +
                     (text ? text : "?"));
}

void set_device(int device) { check(cudaSetDevice(device), "cudaSetDevice"); }

Stream::Stream(int device) {
  set_device(device);
  // Non-blocking: never implicitly ordered with the legacy default stream; every ordering
  // with ORT's compute stream is an explicit event wait.
  check(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
}

Stream::~Stream() {
  if (s_ != nullptr) {
    ignore(cudaStreamSynchronize(s_));
    ignore(cudaStreamDestroy(s_));
  }
}

PinnedBlock::PinnedBlock(size_t bytes) {
  if (bytes == 0) return;
  const auto page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  size_ = (bytes + page - 1) / page * page;
  // From one huge page on, the block starts on a huge-page boundary and asks for transparent
  // huge pages: pinning and the device's mapping then handle 2 MiB pages, not 4 KiB ones. The
  // slack mapped to find the boundary is unmapped at once: the block is still size_ bytes.
  const size_t slack = size_ >= kHugePage ? kHugePage : 0;
  void* p = ::mmap(nullptr, size_ + slack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                   -1, 0);
  if (p == MAP_FAILED) {
    const int e = errno;
    size_ = 0;
    fail(ORT_FAIL, "cannot map " + std::to_string(bytes) + " bytes of host memory: " +
                       std::strerror(e));
  }
  char* base = static_cast<char*>(p);
  data_ = base;
  if (slack != 0) {
    const auto at = reinterpret_cast<uintptr_t>(base);
    data_ = reinterpret_cast<char*>((at + kHugePage - 1) / kHugePage * kHugePage);
    const size_t head = static_cast<size_t>(data_ - base);
    if (head != 0) ::munmap(base, head);
    if (slack - head != 0) ::munmap(data_ + size_, slack - head);
    // Advice only: without transparent huge pages the block is pinned in 4 KiB pages.
    (void)::madvise(data_, size_ / kHugePage * kHugePage, MADV_HUGEPAGE);
  }
  const cudaError_t e = cudaHostRegister(data_, size_, cudaHostRegisterPortable);
  if (e != cudaSuccess) {
    ::munmap(data_, size_);
    data_ = nullptr;
    const size_t was = size_;
    size_ = 0;
    check(e, ("cudaHostRegister of " + std::to_string(was) + " bytes").c_str());
  }
  registered_ = true;
  counters().pinned_bytes += static_cast<int64_t>(size_);
  counters().pinned_allocs += 1;
}

PinnedBlock::~PinnedBlock() {
  if (data_ == nullptr) return;
  if (registered_) {
    ignore(cudaHostUnregister(data_));
    counters().pinned_bytes -= static_cast<int64_t>(size_);
  }
  ::munmap(data_, size_);
}

DeviceBuffer::DeviceBuffer(int device, size_t bytes) {
  set_device(device);
  check(cudaMalloc(&p_, bytes), "cudaMalloc");
}

DeviceBuffer::~DeviceBuffer() {
  if (p_ != nullptr) ignore(cudaFree(p_));
}

TimingEvent::TimingEvent() { check(cudaEventCreate(&e_), "cudaEventCreate"); }

TimingEvent::~TimingEvent() {
  if (e_ != nullptr) ignore(cudaEventDestroy(e_));
}

}  // namespace cuda
}  // namespace ho
