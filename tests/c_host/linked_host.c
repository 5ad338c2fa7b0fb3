/* A host that links libho_onnx_ops.so at build time (instead of having ORT load it) and
 * registers it with RegisterCustomOpsUsingFunction("RegisterCustomOps"); it calls the
 * library's C API directly.
 *
 *   linked_host MODEL MODEL_DIR     prints "registrations=N engines_alive=N" after the
 *                                   session is created; exits 1 on an ORT error.
 */
#include <stdio.h>
#include <string.h>

#include "ho_onnx_c_api.h"
#include "onnxruntime/onnxruntime_c_api.h"

static const OrtApi* g_ort = NULL;

static int failed(OrtStatus* st) {
  if (st == NULL) return 0;
  fprintf(stderr, "linked_host: %s\n", g_ort->GetErrorMessage(st));
  g_ort->ReleaseStatus(st);
  return 1;
}

static long long counter(const char* name) {
  const char* names[64];
  int64_t values[64];
  const size_t n = HoOnnx_GetCounters(names, values, 64);
  for (size_t i = 0; i < n && i < 64; ++i) {
    if (strcmp(names[i], name) == 0) return (long long)values[i];
  }
  return -1;
}

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: linked_host MODEL MODEL_DIR\n");
    return 2;
  }
  g_ort = OrtGetApiBase()->GetApi(14);
  if (g_ort == NULL) return 2;
  OrtEnv* env = NULL;
  OrtSessionOptions* so = NULL;
  OrtSession* session = NULL;
  if (failed(g_ort->CreateEnv(ORT_LOGGING_LEVEL_WARNING, "linked_host", &env))) return 1;
  if (failed(g_ort->CreateSessionOptions(&so))) return 1;
  if (failed(g_ort->AddSessionConfigEntry(so, "ho_onnx.model_dir", argv[2]))) return 1;
  if (failed(g_ort->RegisterCustomOpsUsingFunction(so, "RegisterCustomOps"))) return 1;
  if (failed(g_ort->CreateSession(env, argv[1], so, &session))) return 1;
  printf("registrations=%lld engines_alive=%lld\n", counter("registrations"),
         counter("engines_alive"));
  g_ort->ReleaseSession(session);
  g_ort->ReleaseSessionOptions(so);
  g_ort->ReleaseEnv(env);
  return 0;
}
