/* The C API of the ho-onnx custom-op library (libho_onnx_ops.so).
 *
 * The library is an ONNX Runtime custom-op library: a host registers it with
 * OrtApi::RegisterCustomOpsLibrary_V2 (C) or Ort::SessionOptions::RegisterCustomOpsLibrary
 * (C++), which calls its RegisterCustomOps entry point. Nothing below is needed for that.
 *
 * These functions expose the library's process-wide state (counters, build facts,
 * measurement switches, CUDA helpers) to hosts that want it; the Python module ho_onnx._ops
 * is one such host. Plain C, no ORT types; every function is thread-safe. Functions returning int
 * return 0 on success and -1 on failure, with the reason in HoOnnx_LastError().
 */
#ifndef HO_ONNX_C_API_H_
#define HO_ONNX_C_API_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define HO_ONNX_EXPORT __declspec(dllexport)
#else
#define HO_ONNX_EXPORT __attribute__((visibility("default")))
#endif

/* Version of this C API (the functions and structs below). */
#define HO_ONNX_C_API_VERSION 3

HO_ONNX_EXPORT int HoOnnx_ApiVersion(void);

/* The reason of this thread's last failed call ("" when none). Valid until the next call
 * of this thread into the library. */
HO_ONNX_EXPORT const char* HoOnnx_LastError(void);

/* Build facts as a JSON object (static storage, never freed): version, ort_api_version
 * (of the ORT headers it was compiled with), ort_api_required (the ORT C API version it
 * asks the runtime for) and ort_min_version (the onnxruntime release that brought it),
 * c_api_version, cuda_compiled, cxx_compiler, test_hooks (a testing build:
 * csrc/fault_hooks.h), element_types (those the library has; a
 * runtime older than a type's introduction does not get ops for it). */
HO_ONNX_EXPORT const char* HoOnnx_BuildInfoJson(void);

/* Process-wide counters: writes up to `capacity` names (static strings) and values and
 * returns how many counters there are (call with capacity 0 to size the arrays). */
HO_ONNX_EXPORT size_t HoOnnx_GetCounters(const char** names, int64_t* values, size_t capacity);

/* Reset the monotonic counters (bytes, counts, wait time); the memory gauges are kept. */
HO_ONNX_EXPORT void HoOnnx_ResetCounters(void);

/* Measurement switches (both off by default): "cuda_timing" (time every copy of the CUDA
 * engine: HoOnnx_CudaTransferTimes), "arena_trace" (keep every arena sample:
 * HoOnnx_ArenaTrace). `on` != 0 turns one on. -1 for an unknown name. (Fault injection for
 * tests is in testing builds only: csrc/testing/ho_onnx_testing.h.) */
HO_ONNX_EXPORT int HoOnnx_SetTrace(const char* name, int on);

/* CUDA helpers. Without a CUDA build they fail (CudaDeviceCount returns 0). */
HO_ONNX_EXPORT int HoOnnx_CudaDeviceCount(void);
HO_ONNX_EXPORT int HoOnnx_CudaMemInfo(int device, uint64_t* free_bytes, uint64_t* total_bytes);

typedef struct HoOnnxCudaCalibration {
  double h2d_bw; /* bytes/s */
  double d2h_bw;
  uint64_t bytes;
  int device;
  char device_name[256];
} HoOnnxCudaCalibration;
HO_ONNX_EXPORT int HoOnnx_CudaCalibrate(uint64_t bytes, int device, int repeats,
                                        HoOnnxCudaCalibration* out);

typedef struct HoOnnxCudaTransferTimes {
  uint64_t h2d_bytes;
  double h2d_s;
  uint64_t h2d_copies;
  uint64_t d2h_bytes;
  double d2h_s;
  uint64_t d2h_copies;
} HoOnnxCudaTransferTimes;
HO_ONNX_EXPORT int HoOnnx_CudaTransferTimes(int reset, HoOnnxCudaTransferTimes* out);

/* Host memory for a caller's tensors that the library copies from or ORT writes into (a KV
 * cache kept in host memory between runs: ho_onnx.target.ort.generate.KvBuffers): `size`
 * bytes (> 0), page-aligned, zero-filled, pinned (page-locked and registered with CUDA, so
 * that copies to and from a device run at the link's rate, asynchronously) when the library
 * has CUDA and a device; otherwise ordinary pages. *pinned (may be NULL) says which. Free
 * with HoOnnx_HostFree (an address it did not return is an error). Both return 0, or -1 with
 * HoOnnx_LastError. Added in C API version 3. */
HO_ONNX_EXPORT int HoOnnx_HostAlloc(uint64_t size, void** out, int* pinned);
HO_ONNX_EXPORT int HoOnnx_HostFree(void* ptr);

/* The arena samples kept while "arena_trace" is set (each Wait with
 * ho_onnx.sample_arena=1): writes up to `capacity` of them, oldest first, and returns how
 * many there were before the call (capacity 0 sizes); `reset` != 0 forgets the ones
 * written, so a caller loops until the return is at most its capacity. */
typedef struct HoOnnxArenaSample {
  char node[128]; /* the sampling Wait's node name, truncated */
  int64_t in_use;
  int64_t max_in_use;
  int64_t total_allocated;
} HoOnnxArenaSample;
HO_ONNX_EXPORT size_t HoOnnx_ArenaTrace(HoOnnxArenaSample* out, size_t capacity, int reset);

#ifdef __cplusplus
}
#endif

#endif /* HO_ONNX_C_API_H_ */
