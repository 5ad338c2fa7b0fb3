/* Calls the library's RegisterCustomOps as an older ONNX Runtime would: through an
 * OrtApiBase that serves API versions 1..MAX_API only and reports VERSION (the functions
 * themselves are the real runtime's), then creates a session for MODEL with those options.
 *
 *   fake_runtime LIBRARY MODEL VERSION MAX_API
 *
 * Prints "register: ok" or "register: <ORT error message>", then (after a successful
 * registration) "session: ok" or "session: <message>". Exits 0 unless the harness fails.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

#include "onnxruntime/onnxruntime_c_api.h"

static const OrtApiBase* g_real = NULL;
static uint32_t g_max_api = 0;
static const char* g_version = NULL;

static const OrtApi* ORT_API_CALL fake_get_api(uint32_t version) NO_EXCEPTION {
  return version <= g_max_api ? g_real->GetApi(version) : NULL;
}

static const char* ORT_API_CALL fake_version(void) NO_EXCEPTION { return g_version; }

int main(int argc, char** argv) {
  if (argc != 5) {
    fprintf(stderr, "usage: fake_runtime LIBRARY MODEL VERSION MAX_API\n");
    return 2;
  }
  g_real = OrtGetApiBase();
  g_version = argv[3];
  g_max_api = (uint32_t)atoi(argv[4]);
  const OrtApi* ort = g_real->GetApi(14);
  if (ort == NULL) return 3;
  OrtApiBase fake = {fake_get_api, fake_version};

  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    fprintf(stderr, "dlopen: %s\n", dlerror());
    return 3;
  }
  typedef OrtStatus*(ORT_API_CALL * RegisterFn)(OrtSessionOptions*, const OrtApiBase*);
  RegisterFn reg = (RegisterFn)dlsym(lib, "RegisterCustomOps");
  if (reg == NULL) return 3;

  OrtEnv* env = NULL;
  OrtSessionOptions* so = NULL;
  if (ort->CreateEnv(ORT_LOGGING_LEVEL_ERROR, "fake_runtime", &env) != NULL) return 3;
  if (ort->CreateSessionOptions(&so) != NULL) return 3;
  OrtStatus* st = reg(so, &fake);
  if (st != NULL) {
    printf("register: %s\n", ort->GetErrorMessage(st));
    ort->ReleaseStatus(st);
  } else {
    printf("register: ok\n");
    OrtSession* session = NULL;
    st = ort->CreateSession(env, argv[2], so, &session);
    if (st != NULL) {
      printf("session: %s\n", ort->GetErrorMessage(st));
      ort->ReleaseStatus(st);
    } else {
      printf("session: ok\n");
      ort->ReleaseSession(session);
    }
  }
  ort->ReleaseSessionOptions(so);
  ort->ReleaseEnv(env);
  /* the library stays loaded: ORT-owned op domains point into it */
  return 0;
}
