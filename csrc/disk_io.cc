#include "disk_io.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <list>
#include <mutex>
#include <new>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common.h"
#include "weight_file.h"

namespace ho {

namespace {

constexpr size_t kBounceAlign = 4096;  // alignment of bounce buffers (>= any accepted DIO alignment)
constexpr uint64_t kSmallBounce = 64 << 10;  // a piece this small bounces through its own buffer

int64_t env_int(const char* name, int64_t dflt, int64_t lo, int64_t hi) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return dflt;
  char* end = nullptr;
  const long long x = std::strtoll(v, &end, 10);
  if (end == v || *end != '\0' || x < lo || x > hi) return dflt;
  return static_cast<int64_t>(x);
}

bool direct_enabled() {
  static const bool on = env_int("HO_ONNX_DISK_DIRECT", 1, 0, 1) != 0;
  return on;
}

bool is_pow2(size_t x) { return x != 0 && (x & (x - 1)) == 0; }
uint64_t round_down(uint64_t x, uint64_t a) { return x - x % a; }
uint64_t round_up(uint64_t x, uint64_t a) { return round_down(x + a - 1, a); }

std::string errno_text(int e) { return std::strerror(e); }

// An aligned heap buffer (RAII).
class AlignedBuf {
 public:
  explicit AlignedBuf(size_t size)
      : data_(static_cast<char*>(::operator new(size, std::align_val_t(kBounceAlign)))),
        size_(size) {}
  ~AlignedBuf() { ::operator delete(data_, std::align_val_t(kBounceAlign)); }
  AlignedBuf(const AlignedBuf&) = delete;
  AlignedBuf& operator=(const AlignedBuf&) = delete;
  char* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  char* data_;
  size_t size_;
};

// One bounce buffer per I/O thread, freed when the thread exits.
AlignedBuf& bounce() {
  thread_local std::unique_ptr<AlignedBuf> buf;
  if (!buf) buf = std::make_unique<AlignedBuf>(disk_chunk_bytes() + kBounceAlign);
  return *buf;
}

// One small bounce buffer per thread (a row, the ragged ends of a weight), freed when the
// thread exits: kSmallBounce bytes, where the chunk-sized one above would keep 8 MiB for the
// life of every compute thread that reads rows (GatherRows on the disk tier).
AlignedBuf& small_bounce() {
  thread_local std::unique_ptr<AlignedBuf> buf;
  if (!buf) buf = std::make_unique<AlignedBuf>(static_cast<size_t>(kSmallBounce));
  return *buf;
}

// RAII around the caller's write guard.
class WriteScope {
 public:
  explicit WriteScope(const DiskFile::Guard& g) : g_(g), ok_(g ? g(true) : true) {}
  ~WriteScope() {
    if (ok_ && g_) g_(false);
  }
  WriteScope(const WriteScope&) = delete;
  WriteScope& operator=(const WriteScope&) = delete;
  bool ok() const { return ok_; }

 private:
  const DiskFile::Guard& g_;
  bool ok_;
};

std::mutex g_busy_mu;
int g_busy_active = 0;
std::chrono::steady_clock::time_point g_busy_since;

}  // namespace

size_t disk_chunk_bytes() {
  // 8 MiB by default; at least 64 KiB, a multiple of 4096.
  static const size_t bytes = static_cast<size_t>(
      round_up(static_cast<uint64_t>(env_int("HO_ONNX_DISK_CHUNK_KB", 8192, 64, 1 << 20)) * 1024,
               kBounceAlign));
  return bytes;
}

uint64_t disk_chunk_for(uint64_t bytes, int threads) {
  const uint64_t cap = disk_chunk_bytes();
  const uint64_t floor = std::min<uint64_t>(cap, uint64_t{1} << 20);
  const uint64_t n = static_cast<uint64_t>(std::max(threads, 1));
  const uint64_t share = round_up((bytes + n - 1) / n, kBounceAlign);
  return std::max(floor, std::min(cap, share));
}

int disk_io_threads() {
  static const int n = static_cast<int>(env_int("HO_ONNX_IO_THREADS", 2, 1, 16));
  return n;
}

DiskBusy::DiskBusy() {
  std::lock_guard<std::mutex> lock(g_busy_mu);
  if (g_busy_active++ == 0) g_busy_since = std::chrono::steady_clock::now();
}

DiskBusy::~DiskBusy() {
  std::lock_guard<std::mutex> lock(g_busy_mu);
  if (--g_busy_active == 0) {
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::steady_clock::now() - g_busy_since)
                        .count();
    counters().disk_read_ns += static_cast<uint64_t>(ns);
  }
}

// ---- the open-file cache ---------------------------------------------------------------

struct DiskFile::Fds {
  int fd = -1;         // buffered
  int fd_direct = -1;  // O_DIRECT, -1 when refused or disabled
  Fds() = default;
  ~Fds() {
    if (fd_direct >= 0) ::close(fd_direct);
    if (fd >= 0) ::close(fd);
  }
  Fds(const Fds&) = delete;
  Fds& operator=(const Fds&) = delete;
};

namespace {

// Process-wide: the descriptors of at most disk_open_files() data files are kept while idle;
// a read holds its file's descriptors (shared_ptr) until it returns, so an eviction never
// closes a descriptor under a read. Never destroyed (DiskFiles may outlive static
// destructors in a server that exits with sessions alive).
class OpenFileCache {
 public:
  using FdsPtr = std::shared_ptr<const DiskFile::Fds>;

  FdsPtr get(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = index_.find(id);
    if (it == index_.end()) return nullptr;
    lru_.splice(lru_.begin(), lru_, it->second);  // most recently used first
    return it->second->second;
  }

  // Keeps `fds` for `id` (or the entry another thread put meanwhile, which is returned);
  // closes the least recently used beyond the bound. The descriptors are closed outside the
  // lock (an eviction victim may be in use: it closes with its last reader).
  FdsPtr put(uint64_t id, FdsPtr fds) {
    std::vector<FdsPtr> evicted;
    FdsPtr kept;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = index_.find(id);
      if (it != index_.end()) {
        lru_.splice(lru_.begin(), lru_, it->second);
        kept = it->second->second;
      } else {
        lru_.emplace_front(id, std::move(fds));
        index_[id] = lru_.begin();
        kept = lru_.front().second;
      }
      const size_t cap = disk_open_files();
      while (lru_.size() > cap) {
        evicted.push_back(std::move(lru_.back().second));
        index_.erase(lru_.back().first);
        lru_.pop_back();
      }
    }
    return kept;  // `evicted` (and a losing `fds`) close here, outside the lock
  }

  void erase(uint64_t id) {
    FdsPtr gone;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = index_.find(id);
    if (it == index_.end()) return;
    gone = std::move(it->second->second);
    lru_.erase(it->second);
    index_.erase(it);
  }

  // Closes every idle entry (an open refused with EMFILE: make room, then try once more).
  void drop_all() {
    std::list<std::pair<uint64_t, FdsPtr>> gone;
    std::lock_guard<std::mutex> lock(mu_);
    gone.swap(lru_);
    index_.clear();
  }

  size_t size() {
    std::lock_guard<std::mutex> lock(mu_);
    return lru_.size();
  }

  // fork(): never inherit the lock held by another thread (see registration.cc).
  void lock() { mu_.lock(); }
  void unlock() { mu_.unlock(); }

 private:
  std::mutex mu_;
  std::list<std::pair<uint64_t, FdsPtr>> lru_;
  std::unordered_map<uint64_t, std::list<std::pair<uint64_t, FdsPtr>>::iterator> index_;
};

OpenFileCache& open_files() {
  static OpenFileCache* c = new OpenFileCache();
  return *c;
}

[[maybe_unused]] const int g_cache_atfork = pthread_atfork(
    [] { open_files().lock(); }, [] { open_files().unlock(); }, [] { open_files().unlock(); });

std::atomic<uint64_t> g_next_file_id{1};

}  // namespace

size_t disk_open_files() {
  static const size_t n = [] {
    struct rlimit rl {};
    int64_t dflt = 64;
    if (::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
      dflt = static_cast<int64_t>(rl.rlim_cur / 8);
    }
    dflt = std::max<int64_t>(4, std::min<int64_t>(256, dflt));
    return static_cast<size_t>(env_int("HO_ONNX_DISK_OPEN_FILES", dflt, 1, 65536));
  }();
  return n;
}

size_t disk_open_files_now() { return open_files().size(); }

// ---- DiskFile -----------------------------------------------------------------------------

std::shared_ptr<DiskFile> DiskFile::open(const WeightFile& file) {
  std::shared_ptr<DiskFile> f(new DiskFile());
  f->id_ = g_next_file_id.fetch_add(1);
  f->path_ = file.path();
  f->model_dir_ = file.model_dir();
  f->location_ = file.location();
  f->dev_ = file.dev();
  f->ino_ = file.ino();
  open_files().put(f->id_, f->make_fds(file.fd(), true));
  return f;
}

std::shared_ptr<const DiskFile::Fds> DiskFile::make_fds(int from, bool first) {
  auto f = std::make_shared<Fds>();
  f->fd = ::fcntl(from, F_DUPFD_CLOEXEC, 0);
  if (f->fd < 0) {
    fail(ORT_FAIL, "cannot duplicate the descriptor of '" + path_ + "': " + errno_text(errno));
  }
  struct stat st {};
  if (::fstat(f->fd, &st) != 0) {
    fail(ORT_FAIL, "cannot stat '" + path_ + "': " + errno_text(errno));
  }
  if (!S_ISREG(st.st_mode)) fail(ORT_NO_SUCHFILE, "'" + path_ + "' is not a regular file");
  if (!direct_enabled()) return f;
  if (first) {
    size_t off_align = 4096, mem_align = 4096;
#ifdef STATX_DIOALIGN
    struct statx sx {};
    if (::statx(f->fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 &&
        (sx.stx_mask & STATX_DIOALIGN) != 0) {
      if (sx.stx_dio_offset_align == 0) return f;  // the file system has no direct I/O here
      off_align = sx.stx_dio_offset_align;
      mem_align = sx.stx_dio_mem_align;
    }
#endif
    if (!is_pow2(off_align) || !is_pow2(mem_align) || off_align > kBounceAlign ||
        mem_align > kBounceAlign) {
      return f;  // unusual alignment: stay buffered
    }
    off_align_ = off_align;
    mem_align_ = mem_align;
  } else if (!direct()) {
    return f;  // refused before: stay buffered
  }
  // EINVAL: the file system refuses O_DIRECT (reads then go through the page cache).
  // A second open file description of the same file (O_DIRECT is per description): through
  // the descriptor's /proc entry, which names the open file, not a path looked up again.
  // Without /proc the file is read through the page cache.
  const std::string self = "/proc/self/fd/" + std::to_string(f->fd);
  f->fd_direct = ::open(self.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
  if (f->fd_direct >= 0) {
    struct stat st2 {};
    if (::fstat(f->fd_direct, &st2) != 0 || st2.st_dev != st.st_dev ||
        st2.st_ino != st.st_ino) {
      ::close(f->fd_direct);
      f->fd_direct = -1;
    }
  }
  if (first) direct_ok_ = f->fd_direct >= 0;
  return f;
}

DiskFile::~DiskFile() { open_files().erase(id_); }

std::shared_ptr<const DiskFile::Fds> DiskFile::fds(const std::string& who) {
  std::shared_ptr<const Fds> f = open_files().get(id_);
  if (f) return f;
  counters().disk_reopens += 1;
  try {
    f = reopen(who);
  } catch (const Error& e) {
    // Out of descriptors (the process's or the system's): close every idle cached file and
    // try once more.
    const std::string msg = e.what();
    if (open_files().size() == 0 || (msg.find(errno_text(EMFILE)) == std::string::npos &&
                                     msg.find(errno_text(ENFILE)) == std::string::npos)) {
      throw;
    }
    open_files().drop_all();
    f = reopen(who);
  }
  return open_files().put(id_, std::move(f));
}

// The rules of session creation again (resolve_weight_file: inside the model folder, no
// symbolic link below it), and it must be the very file validated then: a file replaced
// since (another inode at the location) is refused, never read.
std::shared_ptr<const DiskFile::Fds> DiskFile::reopen(const std::string& who) {
  std::shared_ptr<WeightFile> wf;
  try {
    wf = resolve_weight_file(model_dir_, location_);
  } catch (const Error& e) {
    fail(ORT_FAIL, who + ": cannot open the data file again (its descriptor was closed to "
                         "bound open files): " + e.what());
  }
  if (wf->dev() != dev_ || wf->ino() != ino_) {
    fail(ORT_FAIL, who + ": '" + path_ + "' is not the data file validated when the session "
                         "was created (it was replaced since); create a new session");
  }
  return make_fds(wf->fd(), false);
}

uint64_t DiskFile::size_now(const Fds& f) const {
  struct stat st {};
  if (::fstat(f.fd, &st) != 0) {
    fail(ORT_FAIL, "cannot stat '" + path_ + "': " + errno_text(errno));
  }
  return static_cast<uint64_t>(st.st_size);
}

int64_t DiskFile::pread_full(int fd, char* buf, size_t n, uint64_t off, bool is_direct,
                             const std::string& who) {
  size_t done = 0;
  while (done < n) {
    const ssize_t r = ::pread(fd, buf + done, n - done, static_cast<off_t>(off + done));
    if (r < 0) {
      const int e = errno;
      if (e == EINTR) continue;
      if (is_direct && e == EINVAL && done == 0) return -1;
      fail(ORT_FAIL, who + ": cannot read '" + path_ + "' at offset " +
                         std::to_string(off + done) + ": " + errno_text(e));
    }
    if (r == 0) break;  // end of file
    done += static_cast<size_t>(r);
    if (is_direct && done % off_align_ != 0) break;  // a direct read ends short only at EOF
  }
  return static_cast<int64_t>(done);
}

void DiskFile::short_read(const Fds& f, uint64_t off, size_t n, int64_t got,
                          const std::string& who) {
  std::string now;
  try {
    now = std::to_string(size_now(f)) + " bytes";
  } catch (const std::exception&) {
    now = "size unknown";
  }
  fail(ORT_FAIL, who + ": unexpected end of file in '" + path_ + "': needed bytes [" +
                     std::to_string(off) + ", " + std::to_string(off + n) + "), got " +
                     std::to_string(got < 0 ? 0 : got) + " (the file is now " + now +
                     "; truncated or replaced after the session was created?)");
}

bool DiskFile::read_buffered(const Fds& f, uint64_t off, size_t n, char* out,
                             const Guard& guard, const std::string& who) {
  WriteScope w(guard);
  if (!w.ok()) return false;
  const int64_t got = pread_full(f.fd, out, n, off, false, who);
  counters().disk_buffered_reads += 1;
  if (got < static_cast<int64_t>(n)) short_read(f, off, n, got, who);
  return true;
}

bool DiskFile::read(uint64_t off, size_t n, char* out, const Guard& guard,
                    const std::string& who) {
  if (n == 0) return true;
  const std::shared_ptr<const Fds> held = fds(who);  // open until this read returns
  const Fds& f = *held;
  if (!direct() || f.fd_direct < 0) return read_buffered(f, off, n, out, guard, who);
  const uint64_t A = off_align_;
  const uint64_t end = off + n;
  const uint64_t m0 = round_up(off, A);
  const uint64_t m1 = round_down(end, A);
  const bool mid_direct =
      m0 < m1 && reinterpret_cast<uintptr_t>(out + (m0 - off)) % mem_align_ == 0;
  // Pieces: [off, m0) bounce, [m0, m1) direct into out, [m1, end) bounce; or all bounce.
  uint64_t p = off;
  while (p < end) {
    if (mid_direct && p == m0) {
      int64_t got;
      {
        WriteScope w(guard);
        if (!w.ok()) return false;
        got = pread_full(f.fd_direct, out + (m0 - off), m1 - m0, m0, true, who);
      }
      if (got < 0) {
        direct_ok_ = false;  // EINVAL: refused; the rest goes through the page cache
        return read_buffered(f, p, end - p, out + (p - off), guard, who);
      }
      if (got < static_cast<int64_t>(m1 - m0)) short_read(f, m0, m1 - m0, got, who);
      counters().disk_direct_reads += 1;
      p = m1;
      continue;
    }
    const uint64_t piece_end = mid_direct && p < m0 ? m0 : end;
    // A small piece (a row, the ragged ends of a weight) bounces through the thread's small
    // buffer (no allocation per row); the chunk-sized one is for the I/O threads.
    const uint64_t need = round_up(piece_end, A) - round_down(p, A);
    AlignedBuf& b = need <= kSmallBounce ? small_bounce() : bounce();
    const uint64_t a0 = round_down(p, A);
    const uint64_t a1 = std::min<uint64_t>(a0 + (b.size() - b.size() % A), round_up(piece_end, A));
    const uint64_t q = std::min<uint64_t>(piece_end, a1);
    const int64_t got = pread_full(f.fd_direct, b.data(), a1 - a0, a0, true, who);
    if (got < 0) {
      direct_ok_ = false;
      return read_buffered(f, p, end - p, out + (p - off), guard, who);
    }
    if (got < static_cast<int64_t>(q - a0)) {
      short_read(f, p, q - p, got - static_cast<int64_t>(p - a0), who);
    }
    counters().disk_direct_reads += 1;
    {
      WriteScope w(guard);
      if (!w.ok()) return false;
      std::memcpy(out + (p - off), b.data() + (p - a0), q - p);
    }
    p = q;
  }
  return true;
}

std::shared_ptr<DiskFile> DiskFiles::open_range(const WeightFile& wf, int64_t offset,
                                                int64_t length) {
  if (offset < 0 || length < 0) fail(ORT_INVALID_ARGUMENT, "negative offset or length");
  const std::string& realpath = wf.path();
  std::shared_ptr<DiskFile> file = files_.get(
      wf.key() + '\n' + wf.model_dir() + '\n' + wf.location(), [&] { return DiskFile::open(wf); });
  const uint64_t size = wf.size();  // fstat of the validated descriptor, just now
  const auto off = static_cast<uint64_t>(offset);
  const auto len = static_cast<uint64_t>(length);
  if (off > size || len > size - off) {
    fail(ORT_INVALID_ARGUMENT, "offset " + std::to_string(offset) + " + length " +
                                   std::to_string(length) + " is past the end of '" + realpath +
                                   "' (" + std::to_string(size) + " bytes)");
  }
  return file;
}

}  // namespace ho
