/* A C host of the ho-onnx custom-op library: ONNX Runtime's C API only, no Python.
 *
 *   run_model LIBRARY MODEL MODEL_DIR INPUTS OUTPUTS RUNS
 *
 * Registers LIBRARY (libho_onnx_ops.so) with RegisterCustomOpsLibrary_V2 after setting the
 * session config entries "ho_onnx.model_dir" = MODEL_DIR and "session.disable_prepacking"
 * = "1", creates a session for MODEL (ORT's DEFAULT execution order: the C API cannot
 * choose PRIORITY_BASED), feeds the tensors of INPUTS (in the session's input order) and
 * runs RUNS times, appending every run's outputs to OUTPUTS. Then it reads the library's
 * counters through its own C API (ho_onnx_c_api.h) and prints them as "name=value ...".
 *
 * Tensor file format (little-endian, one record per tensor):
 *   uint32 element type (ONNXTensorElementDataType), uint32 rank, int64 dims[rank],
 *   the elements' raw bytes.
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ho_onnx_c_api.h"
#include "onnxruntime/onnxruntime_c_api.h"

/* The API version this host asks for: the newest of the functions it calls
 * (RegisterCustomOpsLibrary_V2: API 14), below the headers' ORT_API_VERSION so that every
 * runtime the library supports (onnxruntime >= 1.18) serves it. */
#define HOST_ORT_API_VERSION 14

static const OrtApi* g_ort = NULL;

static void die(const char* what, const char* msg) {
  fprintf(stderr, "run_model: %s: %s\n", what, msg);
  exit(1);
}

/* Every ORT call goes through CHECK: a failure prints ORT's message and exits 1. */
#define CHECK(expr)                                             \
  do {                                                          \
    OrtStatus* st_ = (expr);                                    \
    if (st_ != NULL) {                                          \
      die(#expr, g_ort->GetErrorMessage(st_));                  \
    }                                                           \
  } while (0)

static size_t elem_size(uint32_t type) {
  switch (type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT32:
      return 4;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL:
      return 1;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT16:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT16:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16:
      return 2;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT64:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE:
      return 8;
    default:
      return 0;
  }
}

static void read_exact(FILE* f, void* p, size_t n) {
  if (n != 0 && fread(p, 1, n, f) != n) die("read", "short inputs file");
}

static void write_exact(FILE* f, const void* p, size_t n) {
  if (n != 0 && fwrite(p, 1, n, f) != n) die("write", "cannot write outputs file");
}

typedef struct Tensor {
  uint32_t type;
  uint32_t rank;
  int64_t dims[16];
  void* data;
  size_t bytes;
} Tensor;

static void read_tensor(FILE* f, Tensor* t) {
  read_exact(f, &t->type, 4);
  read_exact(f, &t->rank, 4);
  if (t->rank > 16) die("read", "rank > 16");
  read_exact(f, t->dims, 8 * (size_t)t->rank);
  size_t numel = 1;
  for (uint32_t i = 0; i < t->rank; ++i) numel *= (size_t)t->dims[i];
  const size_t es = elem_size(t->type);
  if (es == 0) die("read", "unsupported element type");
  t->bytes = numel * es;
  t->data = malloc(t->bytes ? t->bytes : 1);
  if (t->data == NULL) die("read", "out of memory");
  read_exact(f, t->data, t->bytes);
}

static void write_output(FILE* f, OrtValue* v) {
  OrtTensorTypeAndShapeInfo* info = NULL;
  CHECK(g_ort->GetTensorTypeAndShape(v, &info));
  ONNXTensorElementDataType type;
  size_t rank = 0, numel = 0;
  int64_t dims[16];
  CHECK(g_ort->GetTensorElementType(info, &type));
  CHECK(g_ort->GetDimensionsCount(info, &rank));
  if (rank > 16) die("output", "rank > 16");
  CHECK(g_ort->GetDimensions(info, dims, rank));
  CHECK(g_ort->GetTensorShapeElementCount(info, &numel));
  g_ort->ReleaseTensorTypeAndShapeInfo(info);
  const size_t es = elem_size((uint32_t)type);
  if (es == 0) die("output", "unsupported element type");
  void* data = NULL;
  CHECK(g_ort->GetTensorMutableData(v, &data));
  const uint32_t t32 = (uint32_t)type, r32 = (uint32_t)rank;
  write_exact(f, &t32, 4);
  write_exact(f, &r32, 4);
  write_exact(f, dims, 8 * rank);
  write_exact(f, data, numel * es);
}

int main(int argc, char** argv) {
  if (argc != 7) {
    fprintf(stderr, "usage: run_model LIBRARY MODEL MODEL_DIR INPUTS OUTPUTS RUNS\n");
    return 2;
  }
  const char* library = argv[1];
  const char* model = argv[2];
  const char* model_dir = argv[3];
  const int runs = atoi(argv[6]);

  g_ort = OrtGetApiBase()->GetApi(HOST_ORT_API_VERSION);
  if (g_ort == NULL) die("GetApi", "the runtime does not serve this API version");

  OrtEnv* env = NULL;
  CHECK(g_ort->CreateEnv(ORT_LOGGING_LEVEL_WARNING, "ho_onnx_c_host", &env));
  OrtSessionOptions* so = NULL;
  CHECK(g_ort->CreateSessionOptions(&so));
  /* Config entries first: the library reads them when it is registered. */
  CHECK(g_ort->AddSessionConfigEntry(so, "ho_onnx.model_dir", model_dir));
  CHECK(g_ort->AddSessionConfigEntry(so, "session.disable_prepacking", "1"));
  /* ORT's memory-pattern block is not in the planner's budget (README). */
  CHECK(g_ort->DisableMemPattern(so));
  CHECK(g_ort->RegisterCustomOpsLibrary_V2(so, library));
  OrtSession* session = NULL;
  CHECK(g_ort->CreateSession(env, model, so, &session));

  OrtAllocator* alloc = NULL;
  CHECK(g_ort->GetAllocatorWithDefaultOptions(&alloc));
  size_t n_in = 0, n_out = 0;
  CHECK(g_ort->SessionGetInputCount(session, &n_in));
  CHECK(g_ort->SessionGetOutputCount(session, &n_out));
  char** in_names = calloc(n_in, sizeof(char*));
  char** out_names = calloc(n_out, sizeof(char*));
  Tensor* tensors = calloc(n_in, sizeof(Tensor));
  OrtValue** inputs = calloc(n_in, sizeof(OrtValue*));
  OrtValue** outputs = calloc(n_out, sizeof(OrtValue*));
  if (!in_names || !out_names || !tensors || !inputs || !outputs) die("main", "out of memory");

  OrtMemoryInfo* cpu = NULL;
  CHECK(g_ort->CreateCpuMemoryInfo(OrtArenaAllocator, OrtMemTypeDefault, &cpu));
  FILE* fin = fopen(argv[4], "rb");
  if (fin == NULL) die("open", argv[4]);
  for (size_t i = 0; i < n_in; ++i) {
    CHECK(g_ort->SessionGetInputName(session, i, alloc, &in_names[i]));
    read_tensor(fin, &tensors[i]);
    CHECK(g_ort->CreateTensorWithDataAsOrtValue(
        cpu, tensors[i].data, tensors[i].bytes, tensors[i].dims, tensors[i].rank,
        (ONNXTensorElementDataType)tensors[i].type, &inputs[i]));
  }
  fclose(fin);
  for (size_t i = 0; i < n_out; ++i) {
    CHECK(g_ort->SessionGetOutputName(session, i, alloc, &out_names[i]));
  }

  FILE* fout = fopen(argv[5], "wb");
  if (fout == NULL) die("open", argv[5]);
  for (int r = 0; r < runs; ++r) {
    CHECK(g_ort->Run(session, NULL, (const char* const*)in_names, (const OrtValue* const*)inputs,
                     n_in, (const char* const*)out_names, n_out, outputs));
    for (size_t i = 0; i < n_out; ++i) {
      write_output(fout, outputs[i]);
      g_ort->ReleaseValue(outputs[i]);
      outputs[i] = NULL;
    }
  }
  if (fclose(fout) != 0) die("close", argv[5]);

  /* The library's own C API: ORT loaded LIBRARY, so dlopen hands back that same copy. */
  void* lib = dlopen(library, RTLD_NOW | RTLD_NOLOAD);
  if (lib == NULL) die("dlopen", dlerror());
  size_t (*get_counters)(const char**, int64_t*, size_t) =
      (size_t (*)(const char**, int64_t*, size_t))dlsym(lib, "HoOnnx_GetCounters");
  if (get_counters == NULL) die("dlsym", dlerror());
  const char* names[64];
  int64_t values[64];
  const size_t n = get_counters(names, values, 64);
  for (size_t i = 0; i < n && i < 64; ++i) {
    printf("%s%s=%lld", i ? " " : "", names[i], (long long)values[i]);
  }
  printf("\n");
  dlclose(lib);

  for (size_t i = 0; i < n_in; ++i) {
    g_ort->ReleaseValue(inputs[i]);
    free(tensors[i].data);
    CHECK(g_ort->AllocatorFree(alloc, in_names[i]));
  }
  for (size_t i = 0; i < n_out; ++i) CHECK(g_ort->AllocatorFree(alloc, out_names[i]));
  free(in_names);
  free(out_names);
  free(tensors);
  free(inputs);
  free(outputs);
  g_ort->ReleaseMemoryInfo(cpu);
  g_ort->ReleaseSession(session);
  g_ort->ReleaseSessionOptions(so);
  g_ort->ReleaseEnv(env);
  return 0;
}
