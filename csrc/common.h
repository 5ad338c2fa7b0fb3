// Shared helpers: errors, element types, process-wide counters and debug hooks.
#pragma once

#include <onnxruntime_c_api.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace ho {

// A C++ error that carries the ORT error code it becomes at the ABI boundary.
class Error : public std::runtime_error {
 public:
  Error(OrtErrorCode code, const std::string& msg) : std::runtime_error(msg), code_(code) {}
  OrtErrorCode code() const noexcept { return code_; }

 private:
  OrtErrorCode code_;
};

[[noreturn]] inline void fail(OrtErrorCode code, const std::string& msg) { throw Error(code, msg); }

// Element types the ops are registered for: every fixed-size type of the header.
struct ElemType {
  ONNXTensorElementDataType type;
  const char* name;
  int bits;
};
const ElemType* elem_types();  // terminated by an entry with bits == 0
int elem_bits(ONNXTensorElementDataType t);  // 0 when unsupported

// Bytes of `numel` elements of `bits` bits each (sub-byte types are packed).
size_t byte_size(uint64_t numel, int bits);

// Process-wide counters (see module.cc for their Python names).
struct Counters {
  std::atomic<uint64_t> bytes_loaded{0};
  std::atomic<uint64_t> bytes_stored{0};
  std::atomic<uint64_t> prefetches{0};
  std::atomic<uint64_t> stores{0};
  std::atomic<uint64_t> waits{0};
  std::atomic<uint64_t> wait_ns{0};
  std::atomic<uint64_t> alias_copies{0};  // Wait/Detach outputs ORT did not alias: copied
  // Disk tier: payload bytes read from data files (also counted in bytes_loaded), the time
  // at least one disk read was in flight, and the reads done with / without O_DIRECT.
  std::atomic<uint64_t> bytes_read_disk{0};
  std::atomic<uint64_t> disk_read_ns{0};
  std::atomic<uint64_t> disk_direct_reads{0};
  std::atomic<uint64_t> disk_buffered_reads{0};
  std::atomic<int64_t> host_store_bytes{0};
  std::atomic<int64_t> host_pool_bytes_in_use{0};
  std::atomic<int64_t> host_pool_bytes_reserved{0};
  std::atomic<int64_t> engines_alive{0};
};
Counters& counters();

// Test hooks (module.cc: set_debug).
struct Debug {
  std::atomic<int64_t> delay_us{0};
  std::atomic<bool> poison{false};
  std::atomic<bool> skip_wait{false};
};
Debug& debug();

// The 16-byte token a Store writes: [id, magic].
constexpr uint64_t kTokenMagic = 0x4b545f584e4e4f48ULL;  // "HONNX_TK" little-endian
constexpr size_t kTokenBytes = 16;

}  // namespace ho
