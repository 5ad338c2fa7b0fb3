// The ORT custom ops of domain "ai.hyperoffload" (Prefetch, Wait, Store, Detach) on the
// CPU execution provider and, in a CUDA build, on the CUDA execution provider; and the
// library entry point RegisterCustomOps.
//
// Each op is registered once per fixed-size element type T (ORT picks the overload by the
// type of input 0); the trailing `deps` input is a heterogeneous any-type variadic of
// arity >= 0 that is never read. A CUDA build registers a second OrtCustomOp per op and type
// whose GetExecutionProviderType is "CUDAExecutionProvider" when the runtime has that
// provider (OrtApi::GetAvailableProviders; HO_ONNX_CUDA_OPS=0/1 forces it off/on). Kernels
// (kernel.h) call into the registration's Engine (engine.h): one CPU engine and one CUDA
// engine per registration, each created by the first kernel that needs it.
#include "registration.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "common.h"
#include "kernel.h"
#include "ort_tensor.h"
#include "weight_file.h"
#if HO_ONNX_WITH_CUDA
#include "cuda/cuda_api.h"
#endif

namespace ho {

const char* op_name(OpKind k) {
  switch (k) {
    case OpKind::kPrefetch:
      return "Prefetch";
    case OpKind::kWait:
      return "Wait";
    case OpKind::kStore:
      return "Store";
    case OpKind::kDetach:
      return "Detach";
    case OpKind::kGuard:
      return "Guard";
    case OpKind::kPrefetchInput:
      return "PrefetchInput";
    case OpKind::kEmit:
      return "Emit";
    case OpKind::kGatherRows:
      return "GatherRows";
    case OpKind::kHostMatMul:
      return "HostMatMul";
    case OpKind::kFence:
      return "Fence";
  }
  return "?";
}

namespace {
// The identity and version of an open file: any write changes its ctime.
std::string file_version(const WeightFile& f, struct stat* st) {
  if (::fstat(f.fd(), st) != 0) fail(ORT_FAIL, "cannot stat '" + f.path() + "'");
  return f.key() + ":" + std::to_string(st->st_size) + ":" +
         std::to_string(st->st_mtim.tv_sec) + "." + std::to_string(st->st_mtim.tv_nsec) + ":" +
         std::to_string(st->st_ctim.tv_sec) + "." + std::to_string(st->st_ctim.tv_nsec);
}
}  // namespace

// The fingerprint of `f`, cached by its identity and version (`version`, when given, gets
// that key: one fstat serves both).
std::string Registration::fingerprint(const WeightFile& f, std::string* version) {
  struct stat st {};
  const std::string key = file_version(f, &st);
  if (version != nullptr) *version = key;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = fingerprints.find(key);
    if (it != fingerprints.end()) return it->second;
  }
  std::string fp = data_fingerprint(f.fd(), static_cast<uint64_t>(st.st_size));
  std::lock_guard<std::mutex> lock(mu);
  if (fingerprints.size() >= 256) fingerprints.clear();  // bounded
  fingerprints.emplace(key, fp);
  return fp;
}

std::string Registration::content_key(const WeightFile& f) {
  std::string version;
  std::string fp = fingerprint(f, &version);
  return version + "#" + fp;
}

namespace {
std::mutex g_abandoned_mu;
std::vector<std::shared_ptr<Engine>>* g_abandoned = new std::vector<std::shared_ptr<Engine>>();
}  // namespace

void abandon_engine(std::shared_ptr<Engine> engine) {
  std::lock_guard<std::mutex> lock(g_abandoned_mu);
  g_abandoned->push_back(std::move(engine));  // never freed
}

std::string Registration::model_dir_of(const OrtApi* a, const OrtKernelInfo* info) const {
  if (!kernel_config.ok()) return model_dir;
  // The session's entry, else the folder of a library copy configured by its folder's
  // ho_onnx.config (register_ops keeps only that in model_dir on these runtimes).
  std::string v;
  return kernel_config_entry(kernel_config, a, info, kModelDirKey, &v) ? v : model_dir;
}

std::shared_ptr<Engine> Registration::acquire_engine(bool on_cuda) {
  std::lock_guard<std::mutex> lock(mu);
  std::weak_ptr<Engine>& slot = on_cuda ? cuda_engine : engine;
  std::shared_ptr<Engine> e = slot.lock();
  if (e && e->forked_away()) {  // the parent's: a new one for this process
    abandon_engine(std::move(e));
    e.reset();
  }
  if (!e) {
#if HO_ONNX_WITH_CUDA
    e = on_cuda ? make_cuda_engine() : make_cpu_engine(limits);
#else
    if (on_cuda) fail(ORT_FAIL, "built without CUDA");
    e = make_cpu_engine(limits);
#endif
    slot = e;
  }
  return e;
}

namespace {

std::mutex g_regs_mu;
// configuration key -> registration; never freed (one entry per distinct configuration)
std::map<std::string, Registration*>* g_regs = new std::map<std::string, Registration*>();

// A fork while another thread holds one of the library's registration locks (a session
// being created) would leave it locked for good in the child: every lock is taken around
// the fork (the forking thread waits for such a thread to finish) and let go on both sides.
void lock_for_fork() {
  g_regs_mu.lock();
  for (auto& entry : *g_regs) entry.second->mu.lock();
  g_abandoned_mu.lock();
}

void unlock_after_fork() {
  g_abandoned_mu.unlock();
  for (auto it = g_regs->rbegin(); it != g_regs->rend(); ++it) it->second->mu.unlock();
  g_regs_mu.unlock();
}

[[maybe_unused]] const int g_regs_atfork =
    pthread_atfork(lock_for_fork, unlock_after_fork, unlock_after_fork);

constexpr const char* kCudaEp = "CUDAExecutionProvider";
constexpr const char* kCpuEp = "CPUExecutionProvider";

// Number of T-typed inputs before the variadic `deps`.
size_t fixed_inputs(OpKind k) {
  return k == OpKind::kDetach || k == OpKind::kGatherRows || k == OpKind::kHostMatMul ? 2 : 1;
}

const OpDef* def(const OrtCustomOp* op) { return static_cast<const OpDef*>(op); }

// ---- OrtCustomOp callbacks ------------------------------------------------------------------

OrtStatus* to_status(const OrtApi* api, OpKind kind, const std::string& node, const char* what,
                     OrtErrorCode code) {
  std::string msg = what;
  const std::string prefix = "ho_onnx";
  if (msg.compare(0, prefix.size(), prefix) != 0) {
    msg = "ho_onnx " + std::string(op_name(kind)) +
          (node.empty() ? std::string() : " (node '" + node + "')") + ": " + msg;
  }
  return api->CreateStatus(code, msg.c_str());
}

// Runs `body` and turns every C++ exception into an OrtStatus: nothing crosses the ABI.
template <typename Body>
OrtStatus* guarded(const OrtApi* api, OpKind kind, const std::string& node, Body&& body) noexcept {
  try {
    body();
    return nullptr;
  } catch (const Error& e) {
    return to_status(api, kind, node, e.what(), e.code());
  } catch (const std::exception& e) {
    return to_status(api, kind, node, e.what(), ORT_FAIL);
  } catch (...) {
    return to_status(api, kind, node, "unknown C++ exception", ORT_FAIL);
  }
}

OrtStatusPtr ORT_API_CALL create_kernel(const OrtCustomOp* op, const OrtApi* api,
                                        const OrtKernelInfo* info, void** kernel) {
  const OpDef& d = *def(op);
  *kernel = nullptr;
  const std::string node = node_name(api, info);
  return guarded(api, d.kind, node, [&] { *kernel = Kernel::create(d, api, info, node).release(); });
}

OrtStatusPtr ORT_API_CALL compute_kernel(void* kernel, OrtKernelContext* ctx) {
  auto* k = static_cast<Kernel*>(kernel);
  return guarded(k->api, k->kind, k->node, [&] {
    k->compute(ctx);
    (k->gpu ? counters().ops_cuda : counters().ops_cpu) += 1;
  });
}

void ORT_API_CALL destroy_kernel(void* kernel) noexcept {
  delete static_cast<Kernel*>(kernel);
}

const char* ORT_API_CALL get_name(const OrtCustomOp* op) { return op_name(def(op)->kind); }

const char* ORT_API_CALL get_ep(const OrtCustomOp* op) { return def(op)->cuda ? kCudaEp : kCpuEp; }

size_t ORT_API_CALL input_count(const OrtCustomOp* op) { return fixed_inputs(def(op)->kind) + 1; }

ONNXTensorElementDataType ORT_API_CALL input_type(const OrtCustomOp* op, size_t i) {
  if (def(op)->kind == OpKind::kGatherRows && i == 1) return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
  return i < fixed_inputs(def(op)->kind) ? def(op)->type : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
}

OrtCustomOpInputOutputCharacteristic ORT_API_CALL input_char(const OrtCustomOp* op, size_t i) {
  return i < fixed_inputs(def(op)->kind) ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_VARIADIC;
}

// Prefetch: (y, issued optional); Emit: (y, done optional); the others: one output.
size_t ORT_API_CALL output_count(const OrtCustomOp* op) {
  const OpKind k = def(op)->kind;
  return k == OpKind::kPrefetch || k == OpKind::kPrefetchInput || k == OpKind::kEmit ? 2 : 1;
}

ONNXTensorElementDataType ORT_API_CALL output_type(const OrtCustomOp* op, size_t) {
  return def(op)->type;
}

// Optional outputs came with OrtCustomOp version 8 (ORT's custom_ops.cc:
// min_ort_version_with_optional_io_support), below the API version 18 the ops declare.
OrtCustomOpInputOutputCharacteristic ORT_API_CALL output_char(const OrtCustomOp*, size_t i) {
  return i == 0 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
}

// A CUDA PrefetchInput reads its source in host memory (the caller's; ORT passes it as is).
OrtMemType ORT_API_CALL input_mem_type(const OrtCustomOp* op, size_t i) {
  return def(op)->cuda && def(op)->kind == OpKind::kPrefetchInput && i == 0 ? OrtMemTypeCPUInput
                                                                             : OrtMemTypeDefault;
}

int ORT_API_CALL variadic_in_min_arity(const OrtCustomOp*) { return 0; }
int ORT_API_CALL variadic_in_homogeneity(const OrtCustomOp*) { return 0; }
int ORT_API_CALL variadic_out_min_arity(const OrtCustomOp*) { return 1; }
int ORT_API_CALL variadic_out_homogeneity(const OrtCustomOp*) { return 0; }

int ORT_API_CALL start_version(const OrtCustomOp*) { return 1; }
int ORT_API_CALL end_version(const OrtCustomOp*) { return INT_MAX; }

// GetAliasMap has no op argument: one pair of functions per aliasing op.
template <int kIn>
size_t ORT_API_CALL alias_map(int** input_index, int** output_index) {
  *input_index = new int[1]{kIn};
  *output_index = new int[1]{0};
  return 1;
}

void ORT_API_CALL release_alias_map(int* input_index, int* output_index) {
  delete[] input_index;
  delete[] output_index;
}

std::unique_ptr<OpDef> make_op(Registration* reg, OpKind kind, const ElemType& t, bool cuda) {
  auto op = std::make_unique<OpDef>();
  std::memset(static_cast<OrtCustomOp*>(op.get()), 0, sizeof(OrtCustomOp));
  op->version = kOrtApiVersion;  // ORT hands CreateKernelV2 GetApi(op->version)
  op->CreateKernel = nullptr;  // V2 only
  op->GetName = get_name;
  op->GetExecutionProviderType = get_ep;
  op->GetInputType = input_type;
  op->GetInputTypeCount = input_count;
  op->GetOutputType = output_type;
  op->GetOutputTypeCount = output_count;
  op->KernelCompute = nullptr;  // V2 only
  op->KernelDestroy = destroy_kernel;
  op->GetInputCharacteristic = input_char;
  op->GetOutputCharacteristic = output_char;
  op->GetInputMemoryType = input_mem_type;
  op->GetVariadicInputMinArity = variadic_in_min_arity;
  op->GetVariadicInputHomogeneity = variadic_in_homogeneity;
  op->GetVariadicOutputMinArity = variadic_out_min_arity;
  op->GetVariadicOutputHomogeneity = variadic_out_homogeneity;
  op->CreateKernelV2 = create_kernel;
  op->KernelComputeV2 = compute_kernel;
  op->InferOutputShapeFn = nullptr;
  op->GetStartVersion = start_version;
  op->GetEndVersion = end_version;
  op->GetMayInplace = nullptr;
  op->ReleaseMayInplace = nullptr;
  if (kind == OpKind::kWait || kind == OpKind::kFence) {
    op->GetAliasMap = alias_map<0>;
    op->ReleaseAliasMap = release_alias_map;
  } else if (kind == OpKind::kDetach) {
    op->GetAliasMap = alias_map<1>;
    op->ReleaseAliasMap = release_alias_map;
  }
  op->kind = kind;
  op->type = t.type;
  op->bits = t.bits;
  op->cuda = cuda;
  op->reg = reg;
  return op;
}

// ---- configuration ------------------------------------------------------------------------

std::string config_entry(const OrtApi* api, const OrtSessionOptions* options, const char* key,
                         bool* found) {
  int has = 0;
  check(api, api->HasSessionConfigEntry(options, key, &has));
  *found = has != 0;
  if (!has) return {};
  size_t size = 0;
  check(api, api->GetSessionConfigEntry(options, key, nullptr, &size));
  std::string v(size, '\0');
  check(api, api->GetSessionConfigEntry(options, key, v.data(), &size));
  v.resize(std::strlen(v.c_str()));
  return v;
}

// A configuration value and where it came from ("session config entry 'k'" or "'k' in
// <file>"), for its error message.
struct Entry {
  std::string value;
  std::string where;
};
using Entries = std::map<std::string, Entry>;

[[noreturn]] void bad_entry(const Entry& e, const char* want) {
  fail(ORT_INVALID_ARGUMENT, e.where + " must be " + want + ", got '" + e.value + "'");
}

// ---- a model folder that configures itself ------------------------------------------------
// Hosts that cannot set arbitrary session config entries (Triton's onnxruntime backend
// forwards only the entries it knows: docs/serving.md) load a copy of the library from the
// model's own folder; a file of this name beside that copy makes the folder the model
// folder and may set the other ho_onnx.* entries (the session's own entries win).
constexpr const char* kFolderConfigName = "ho_onnx.config";
constexpr off_t kFolderConfigMaxBytes = 64 * 1024;

struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) ::close(fd);
  }
};

// The absolute folder this library file was loaded from, as the dynamic loader recorded it
// when it loaded the file (RTLD_DI_ORIGIN: made absolute against the working directory of
// that moment; a link naming the file is not followed); "" when unknown.
std::string library_folder() {
  Dl_info info{};
  if (::dladdr(reinterpret_cast<const void*>(&library_folder), &info) == 0 ||
      info.dli_fname == nullptr || info.dli_fname[0] == '\0') {
    return {};
  }
  void* self = ::dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  if (self == nullptr) return {};
  char origin[PATH_MAX + 1] = {};
  const int rc = ::dlinfo(self, RTLD_DI_ORIGIN, origin);
  ::dlclose(self);
  return rc == 0 && origin[0] == '/' ? std::string(origin) : std::string();
}

std::string trimmed(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\r");
  if (b == std::string::npos) return {};
  return s.substr(b, s.find_last_not_of(" \t\r") - b + 1);
}

// The entries of `folder`/ho_onnx.config into `out` (lines `key=value`, `#` comments);
// false when the folder has no such file. The file must be a regular file, not a symbolic
// link; it may set every entry but the model folder, which is always its own folder.
bool read_folder_config(const std::string& folder, Entries* out) {
  FdCloser dir{::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)};
  if (dir.fd < 0) return false;  // the library's folder is not readable: no configuration
  const std::string path = folder + "/" + kFolderConfigName;
  FdCloser f{::openat(dir.fd, kFolderConfigName,
                      O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK | O_NOCTTY)};
  if (f.fd < 0) {
    const int e = errno;
    if (e == ENOENT) return false;
    fail(ORT_INVALID_ARGUMENT,
         "cannot open '" + path + "'" +
             (e == ELOOP ? std::string(": it is a symbolic link (refused)")
                         : ": " + std::string(std::strerror(e))));
  }
  struct stat st {};
  if (::fstat(f.fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    fail(ORT_INVALID_ARGUMENT, "'" + path + "' is not a regular file");
  }
  if (st.st_size > kFolderConfigMaxBytes) {
    fail(ORT_INVALID_ARGUMENT, "'" + path + "' has " + std::to_string(st.st_size) +
                                   " bytes, more than a configuration file may (" +
                                   std::to_string(kFolderConfigMaxBytes) + ")");
  }
  std::string text(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t r = ::read(f.fd, &text[got], text.size() - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) fail(ORT_FAIL, "cannot read '" + path + "'");
    got += static_cast<size_t>(r);
  }
  if (text.find('\0') != std::string::npos) {
    fail(ORT_INVALID_ARGUMENT, "'" + path + "' is not a text file");
  }
  size_t line_no = 0;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    const std::string line = trimmed(text.substr(pos, end - pos));
    pos = end + 1;
    ++line_no;
    if (line.empty() || line[0] == '#') continue;
    const std::string at = "'" + path + "' line " + std::to_string(line_no);
    const size_t eq = line.find('=');
    if (eq == std::string::npos) fail(ORT_INVALID_ARGUMENT, at + ": expected key=value");
    const std::string key = trimmed(line.substr(0, eq));
    const std::string value = trimmed(line.substr(eq + 1));
    if (key == kModelDirKey) {
      fail(ORT_INVALID_ARGUMENT, at + ": '" + key +
                                     "' cannot be set here: the model folder is always this "
                                     "file's own folder");
    }
    if (key != kPoolLimitKey && key != kHostBytesKey && key != kSampleArenaKey) {
      fail(ORT_INVALID_ARGUMENT, at + ": unknown entry '" + key + "' (known: " +
                                     kPoolLimitKey + ", " + kHostBytesKey + ", " +
                                     kSampleArenaKey + ")");
    }
    if (!out->emplace(key, Entry{value, "'" + key + "' in '" + path + "'"}).second) {
      fail(ORT_INVALID_ARGUMENT, at + ": '" + key + "' is set twice");
    }
  }
  return true;
}

// The configuration of a registration (README.md lists the entries): the session's config
// entries, then, for the entries it leaves unset, ho_onnx.config beside this library file.
// Sets reg->model_dir to the session's folder entry, else the library's folder when it
// has that file, else "".
void read_config(const OrtApi* api, const OrtSessionOptions* options, Registration* reg,
                 std::string* folder_model_dir) {
  Entries entries;
  for (const char* key : {kModelDirKey, kPoolLimitKey, kHostBytesKey, kSampleArenaKey}) {
    bool has = false;
    std::string v = config_entry(api, options, key, &has);
    if (has) entries.emplace(key, Entry{v, std::string("session config entry '") + key + "'"});
  }
  folder_model_dir->clear();
  const std::string folder = library_folder();
  Entries from_file;
  if (!folder.empty() && read_folder_config(folder, &from_file)) {
    *folder_model_dir = folder;
    for (auto& kv : from_file) entries.emplace(kv.first, kv.second);  // the session's win
  }
  auto it = entries.find(kModelDirKey);
  reg->model_dir = it != entries.end() ? it->second.value : *folder_model_dir;
  {
    const long pages = ::sysconf(_SC_PHYS_PAGES);
    const long page = ::sysconf(_SC_PAGESIZE);
    reg->limits.host_pool_limit =
        pages > 0 && page > 0 ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) / 2 : 0;
  }
  char* end = nullptr;
  it = entries.find(kPoolLimitKey);
  if (it != entries.end()) {
    const std::string& v = it->second.value;
    const unsigned long long x = std::strtoull(v.c_str(), &end, 10);
    if (v.empty() || *end != '\0' || v[0] == '-' || x == 0) {
      bad_entry(it->second, "a positive byte count");
    }
    reg->limits.host_pool_limit = x;
  }
  it = entries.find(kHostBytesKey);
  if (it != entries.end()) {
    const std::string& v = it->second.value;
    const long long x = std::strtoll(v.c_str(), &end, 10);
    if (v.empty() || *end != '\0' || x < 0) bad_entry(it->second, "a byte count");
    reg->host_bytes = x;
  }
  it = entries.find(kSampleArenaKey);
  if (it != entries.end()) {
    const std::string& v = it->second.value;
    if (v != "0" && v != "1") bad_entry(it->second, "0 or 1");
    reg->sample_arena = v == "1";
  }
}

// Whether to register the CUDA-EP variants: a CUDA build, and the runtime has the CUDA
// execution provider (or HO_ONNX_CUDA_OPS=1 forces them, =0 leaves them out).
bool want_cuda_ops(const OrtApi* api) {
#if HO_ONNX_WITH_CUDA
  const char* env = std::getenv("HO_ONNX_CUDA_OPS");
  if (env != nullptr && std::strcmp(env, "0") == 0) return false;
  if (env != nullptr && std::strcmp(env, "1") == 0) return true;
  char** providers = nullptr;
  int n = 0;
  check(api, api->GetAvailableProviders(&providers, &n));
  bool found = false;
  for (int i = 0; i < n; ++i) {
    if (std::strcmp(providers[i], kCudaEp) == 0) found = true;
  }
  check(api, api->ReleaseAvailableProviders(providers, n));
  return found;
#else
  (void)api;
  return false;
#endif
}

// A new registration's domain with every op, per provider and element type the runtime has.
void add_ops(const OrtApi* api, Registration* reg, std::pair<int, int> rt) {
  check(api, api->CreateCustomOpDomain(kDomain, &reg->domain));
  for (bool on_cuda : {false, true}) {
    if (on_cuda && !reg->cuda) continue;
    for (OpKind kind : {OpKind::kPrefetch, OpKind::kWait, OpKind::kStore, OpKind::kDetach,
                        OpKind::kGuard, OpKind::kPrefetchInput, OpKind::kEmit,
                        OpKind::kGatherRows, OpKind::kHostMatMul, OpKind::kFence}) {
      // host memory out: the CPU EP's alone
      if (on_cuda && (kind == OpKind::kEmit || kind == OpKind::kGatherRows ||
                      kind == OpKind::kHostMatMul)) {
        continue;
      }
      for (const ElemType* t = elem_types(); t->bits != 0; ++t) {
        if (!runtime_has_type(t->type, rt)) continue;
        reg->ops.push_back(make_op(reg, kind, *t, on_cuda));
        check(api, api->CustomOpDomain_Add(reg->domain, reg->ops.back().get()));
      }
    }
  }
}

OrtStatus* register_ops(OrtSessionOptions* options, const OrtApi* api, const OrtApiBase* base) {
  const std::pair<int, int> rt = runtime_version(base->GetVersionString());
  auto reg = std::make_unique<Registration>();
  reg->api = api;
  reg->stats = resolve_stats_api(base, rt);
  reg->kernel_config = resolve_kernel_config_api(base, rt);
  std::string folder_model_dir;
  read_config(api, options, reg.get(), &folder_model_dir);
  // Each kernel reads its own session's folder: not part of the configuration (and not
  // kept: the first caller's folder must never serve another session). What is kept is
  // the fallback of a library copy configured by its folder: the same for every session.
  if (reg->kernel_config.ok()) reg->model_dir = folder_model_dir;

  const bool cuda = want_cuda_ops(api);
  const std::string key = std::to_string(reinterpret_cast<uintptr_t>(api)) + '\n' +
                          (reg->kernel_config.ok() ? "\x01per-kernel=" + reg->model_dir
                                                   : "=" + reg->model_dir) +
                          '\n' + std::to_string(reg->host_bytes) + '\n' +
                          std::to_string(reg->limits.host_pool_limit) + '\n' +
                          (reg->sample_arena ? "arena" : "") + '\n' + (cuda ? "cuda" : "cpu");
  std::lock_guard<std::mutex> lock(g_regs_mu);
  auto found = g_regs->find(key);
  if (found != g_regs->end()) {
    check(api, api->AddCustomOpDomain(options, found->second->domain));
  } else {
    if (g_regs->size() >= max_registrations()) {
      fail(ORT_FAIL,
           "this process already holds " + std::to_string(g_regs->size()) +
               " registrations of distinct library configurations (session config entries "
               "ho_onnx.*), the most allowed (HO_ONNX_MAX_REGISTRATIONS); ORT may use each "
               "for the process's life, so none is ever freed. " +
               (reg->kernel_config.ok()
                    ? std::string("Vary fewer ho_onnx.* entries per session.")
                    : std::string("With this onnxruntime (< 1.24) every distinct ") +
                          kModelDirKey +
                          " is one: onnxruntime >= 1.24 serves any number of model folders "
                          "with one registration"));
    }
    reg->cuda = cuda;
    add_ops(api, reg.get(), rt);
    // Kept before AddCustomOpDomain: once ORT holds the domain it must never be freed.
    OrtCustomOpDomain* domain = reg->domain;
    g_regs->emplace(key, reg.release());
    check(api, api->AddCustomOpDomain(options, domain));
  }
  counters().registrations += 1;
  if (cuda) counters().cuda_registrations += 1;
  return nullptr;
}

}  // namespace

size_t registrations_held() {
  std::lock_guard<std::mutex> lock(g_regs_mu);
  return g_regs->size();
}

size_t max_registrations() {
  static const size_t n = [] {
    const char* v = std::getenv("HO_ONNX_MAX_REGISTRATIONS");
    if (v == nullptr || *v == '\0') return size_t{1024};
    char* end = nullptr;
    const unsigned long long x = std::strtoull(v, &end, 10);
    if (*end != '\0' || x == 0 || x > 1000000 || v[0] == '-') return size_t{1024};
    return static_cast<size_t>(x);
  }();
  return n;
}

}  // namespace ho

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  if (api_base == nullptr) return nullptr;
  const OrtApi* api = api_base->GetApi(ho::kOrtApiVersion);
  if (api == nullptr) {
    // The runtime is older than that; API 1 still has CreateStatus.
    const OrtApi* v1 = api_base->GetApi(1);
    const char* have = api_base->GetVersionString();
    return v1 == nullptr
               ? nullptr
               : v1->CreateStatus(ORT_FAIL, (std::string("ho_onnx needs ONNX Runtime API version ") +
                                             std::to_string(ho::kOrtApiVersion) +
                                             " (onnxruntime >= " HO_ONNX_ORT_MIN_VERSION
                                             "), this runtime is " +
                                             (have ? have : "?"))
                                                .c_str());
  }
  try {
    return ho::register_ops(options, api, api_base);
  } catch (const ho::Error& e) {
    return api->CreateStatus(e.code(), (std::string("ho_onnx RegisterCustomOps: ") + e.what()).c_str());
  } catch (const std::exception& e) {
    return api->CreateStatus(ORT_FAIL, (std::string("ho_onnx RegisterCustomOps: ") + e.what()).c_str());
  } catch (...) {
    return api->CreateStatus(ORT_FAIL, "ho_onnx RegisterCustomOps: unknown C++ exception");
  }
}
