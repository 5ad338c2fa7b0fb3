// Shared helpers: errors, element types, process-wide counters and measurement switches.
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
  std::atomic<uint64_t> bytes_emitted{0};  // Emit: tensors handed to the caller (present KV)
  // Gated Prefetches whose gate was empty (experts no token was routed to), and their bytes.
  std::atomic<uint64_t> gated_skips{0};
  std::atomic<uint64_t> bytes_gated{0};
  // The disk tier's staging on the CPU EP: bytes of reads in flight (read, not yet copied
  // out by their Wait) now, and the most at once (reset with the counters).
  std::atomic<uint64_t> disk_staging_bytes{0};
  std::atomic<uint64_t> disk_staging_peak{0};
  std::atomic<uint64_t> bytes_gathered{0};  // GatherRows: table rows copied out
  // HostMatMul: Compute calls that multiplied (an empty input does no work) and the rows
  // (output rows, product of every dim but the last) they computed against host weights.
  std::atomic<uint64_t> host_matmuls{0};
  std::atomic<uint64_t> host_matmul_rows{0};
  // Disk tier: payload bytes read from data files (also counted in bytes_loaded), the time
  // at least one disk read was in flight, and the reads done with / without O_DIRECT.
  std::atomic<uint64_t> bytes_read_disk{0};
  std::atomic<uint64_t> disk_read_ns{0};
  std::atomic<uint64_t> disk_direct_reads{0};
  std::atomic<uint64_t> disk_buffered_reads{0};
  // Disk tier: data files opened again after the bounded open-file cache closed them.
  std::atomic<uint64_t> disk_reopens{0};
  // Expert cache (expert_cache.h): streamed expert loads served from it (no read) and not
  // (read from the tier, then kept), the bytes served from it, and the bytes it holds now.
  std::atomic<uint64_t> expert_cache_hits{0};
  std::atomic<uint64_t> expert_cache_misses{0};
  std::atomic<uint64_t> bytes_expert_cache_hit{0};
  std::atomic<int64_t> expert_cache_bytes{0};
  // Speculative warming (a Prefetch with attribute `warm`): reads started into the expert
  // cache for an expert the next layer's router applied early predicts, their bytes, warm
  // requests the cache already held, and warmed entries a routed Prefetch then asked for
  // (the speculation's hits; hits / warm_reads is its accuracy).
  std::atomic<uint64_t> warm_reads{0};
  std::atomic<uint64_t> bytes_warm_read{0};
  std::atomic<uint64_t> warm_present{0};
  std::atomic<uint64_t> warm_hits{0};
  // Decode cache read-ahead (a Prefetch of a cache group reads the group's next weights
  // early, cpu_engine.cc): reads issued ahead, their bytes, and those their Prefetch took.
  std::atomic<uint64_t> read_aheads{0};
  std::atomic<uint64_t> bytes_read_ahead{0};
  std::atomic<uint64_t> read_ahead_used{0};
  // Session creation: time in the library's kernel creation (every cache op's), and the part
  // of it spent loading host-tier weights into the host store (reading them, pinning them
  // on CUDA). Not reset by reset_counters: they accumulate over the process's sessions.
  std::atomic<uint64_t> kernel_create_ns{0};
  std::atomic<uint64_t> weight_load_ns{0};
  std::atomic<int64_t> host_store_bytes{0};
  std::atomic<int64_t> host_pool_bytes_in_use{0};
  std::atomic<int64_t> host_pool_bytes_reserved{0};
  // Buffers the host pool allocated (not reused): flat once runs repeat (host_memory.h).
  std::atomic<uint64_t> host_pool_allocs{0};
  std::atomic<int64_t> engines_alive{0};
  // CUDA engine: pinned host memory held (weights, ring segments, disk staging) and the
  // number of pinned allocations / CUDA events ever made (flat after warm-up: nothing is
  // allocated or created per run).
  std::atomic<int64_t> pinned_bytes{0};
  // CUDA engine: device memory of the load staging (transfer lifetime rule).
  std::atomic<int64_t> device_staging_bytes{0};
  std::atomic<uint64_t> pinned_allocs{0};
  std::atomic<uint64_t> cuda_events_created{0};
  std::atomic<int64_t> ring_segments{0};
  // RegisterCustomOps calls, and those that also registered the CUDA-EP variants.
  // Cache ops executed (Compute calls that returned success), per execution provider: a
  // test tells a CUDA run from a CPU fallback by these.
  std::atomic<uint64_t> ops_cpu{0};
  std::atomic<uint64_t> ops_cuda{0};
  // CUDA engine only: bytes it copied, per direction (host-to-device: loads of weights,
  // stored activations and disk chunks; device-to-host: stores; device-to-device: the
  // Wait's copy staging -> z). The CPU engine never touches them.
  std::atomic<uint64_t> cuda_bytes_h2d{0};
  std::atomic<uint64_t> cuda_bytes_d2h{0};
  std::atomic<uint64_t> cuda_bytes_d2d{0};
  // ORT's allocator statistics of the Wait's device (AllocatorGetStats, ORT API >= 23),
  // sampled at every Wait; -1 when the runtime or the allocator does not report them.
  std::atomic<int64_t> ort_arena_in_use{-1};
  std::atomic<int64_t> ort_arena_max_in_use{-1};
  std::atomic<int64_t> ort_arena_total_allocated{-1};
  std::atomic<uint64_t> registrations{0};
  std::atomic<uint64_t> cuda_registrations{0};
};
Counters& counters();

// How many forks this process is away from the one the library was loaded in (0 there,
// bumped in every child by a pthread_atfork handler). Engines remember the generation
// they were made in (Engine::forked_away): one of an earlier generation belongs to the
// parent, whose transfer threads (and CUDA context) did not survive the fork.
uint64_t fork_generation();

// Measurement switches (HoOnnx_SetTrace), both off by default. Fault injection for tests
// is not here: fault_hooks.h (testing builds only).
//  cuda_timing: timing events around every copy of the CUDA engine (cuda_transfer_times);
//  arena_trace: every arena sample (ho_onnx.sample_arena=1) is also kept, with its Wait's
//  node name, in order (HoOnnx_ArenaTrace; at most kArenaTraceCap samples).
struct Tracing {
  std::atomic<bool> cuda_timing{false};
  std::atomic<bool> arena_trace{false};
};
Tracing& tracing();

// The 16-byte token a Store writes: [id, magic].
constexpr uint64_t kTokenMagic = 0x4b545f584e4e4f48ULL;  // "HONNX_TK" little-endian
constexpr size_t kTokenBytes = 16;

}  // namespace ho
