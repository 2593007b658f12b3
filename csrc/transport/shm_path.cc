#include "transport/shm_path.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <optional>

#include "verbs/error.h"
#include "verbs/log.h"

namespace hixl::transport {

namespace {

constexpr uint64_t kChunk = 16ull << 20;  // deadline / close checks between chunks
constexpr int kMaxIov = 1024;             // UIO_MAXIOV

std::string cma_error(int err, pid_t pid) {
  std::string s = errno_str(err);
  if (err == EPERM)
    s += ": cross-memory attach to pid " + std::to_string(pid) +
         " is not permitted (another user; Yama ptrace_scope 1 when the peer is not our descendant, 2 or 3; or a "
         "container seccomp profile without CAP_SYS_PTRACE)";
  else if (err == ESRCH)
    s += ": peer process " + std::to_string(pid) + " is gone";
  else if (err == EFAULT)
    s += ": the range is not mapped in the peer (freed after registration?)";
  return s;
}

}  // namespace

std::string boot_id() {
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(f, id);
  return id;
}

std::string shm_probe(pid_t pid, uint64_t addr, uint64_t expect) {
  uint64_t got = 0;
  iovec l{&got, sizeof got}, r{reinterpret_cast<void*>(addr), sizeof got};
  ssize_t n = ::process_vm_readv(pid, &l, 1, &r, 1, 0);
  if (n < 0) return CallDesc("process_vm_readv").arg("pid", pid).hex("addr", addr).str() + ": " + cma_error(errno, pid);
  if (n != ssize_t(sizeof got) || got != expect)
    return "process_vm_readv(pid=" + std::to_string(pid) + ") read the wrong cookie: not the peer it claims to be";
  return "";
}

ShmPath::ShmPath(pid_t peer_pid, std::string peer) : pid_(peer_pid), peer_(std::move(peer)) {
  pidfd_ = int(::syscall(SYS_pidfd_open, pid_, 0));  // exit detection immune to pid reuse (-1: use kill)
}

ShmPath::~ShmPath() {
  stop_worker();
  if (pidfd_ >= 0) ::close(pidfd_);
  if (fence_) ::munmap(fence_, kFenceBytes);
}

void ShmPath::set_fence(uint32_t fd) {
  const std::string path = "/proc/" + std::to_string(pid_) + "/fd/" + std::to_string(fd);
  if (fd == kNoFence) throw Error("shm path to " + peer_ + ": the peer offers no fence for its memory");
  int f = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (f < 0) {
    int err = errno;
    throw Error(CallDesc("open").arg("path", path).str() + ": " + errno_str(err) + " (the peer's fence)", err);
  }
  void* p = ::mmap(nullptr, kFenceBytes, PROT_READ | PROT_WRITE, MAP_SHARED, f, 0);
  int err = errno;
  ::close(f);
  if (p == MAP_FAILED)
    throw Error(CallDesc("mmap").arg("path", path).arg("len", kFenceBytes).str() + ": " + errno_str(err), err);
  if (fence_) ::munmap(fence_, kFenceBytes);
  fence_ = static_cast<FenceSlot*>(p);
}

void ShmPath::set_regions(const std::vector<wire::Region>& regions, uint64_t version) {
  std::vector<wire::Region> v(regions);
  std::sort(v.begin(), v.end(), [](const wire::Region& a, const wire::Region& b) { return a.addr < b.addr; });
  std::lock_guard<std::mutex> g(map_mu_);
  if (version < regions_version_) return;  // an older list overtaken by a newer one
  regions_version_ = version;
  regions_.swap(v);
  hint_ = 0;
}

bool ShmPath::locate(uint64_t addr, uint64_t len, uint32_t* slot, uint32_t* tag, std::shared_ptr<View>* view,
                     uint8_t** at) {
  auto holds = [&](const wire::Region& r) { return len <= r.len && addr >= r.addr && addr - r.addr <= r.len - len; };
  std::lock_guard<std::mutex> g(map_mu_);
  const wire::Region* found = hint_ < regions_.size() && holds(regions_[hint_]) ? &regions_[hint_] : nullptr;
  if (!found) {  // regions may overlap: walk back from the last one starting at or before addr
    auto it = std::upper_bound(regions_.begin(), regions_.end(), addr,
                               [](uint64_t a, const wire::Region& r) { return a < r.addr; });
    while (it != regions_.begin() && !found)
      if (holds(*--it)) found = &*it;
    if (!found) return false;
    hint_ = size_t(found - regions_.data());
  }
  *slot = found->fence;
  *tag = found->tag;
  *view = mapped_locked(addr, len, at);
  return true;
}

bool ShmPath::enter(uint32_t slot, uint32_t tag, std::vector<uint32_t>* held) {
  if (std::find(held->begin(), held->end(), slot) != held->end()) return true;
  if (!fence_ || slot >= kFenceSlots) return false;
  FenceSlot& f = fence_[slot];
  f.inflight.fetch_add(1, std::memory_order_seq_cst);
  if (f.tag.load(std::memory_order_seq_cst) != tag) {  // revoked (or the slot serves another region now)
    f.inflight.fetch_sub(1, std::memory_order_seq_cst);
    return false;
  }
  held->push_back(slot);
  return true;
}

void ShmPath::leave_all(std::vector<uint32_t>* held) {
  for (uint32_t slot : *held) fence_[slot].inflight.fetch_sub(1, std::memory_order_seq_cst);
  held->clear();
}

ShmPath::View::~View() {
  if (base) ::munmap(base, len);
}

bool ShmPath::peer_alive() const {
  if (pidfd_ >= 0) {
    pollfd p{pidfd_, POLLIN, 0};
    return ::poll(&p, 1, 0) == 0;  // readable once the process exited
  }
  return ::kill(pid_, 0) == 0 || errno == EPERM;
}

void ShmPath::set_extents(const std::vector<wire::Extent>& extents) {
  std::lock_guard<std::mutex> g(map_mu_);
  std::map<uint64_t, Mapping> next;
  for (const auto& e : extents) {
    auto it = maps_.find(e.addr);
    if (it != maps_.end() && it->second.ext.len == e.len && it->second.ext.fd == e.fd &&
        it->second.ext.offset == e.offset) {
      next[e.addr] = it->second;  // unchanged: keep the mapping
      maps_.erase(it);
    } else {
      next[e.addr].ext = e;
    }
  }
  maps_.swap(next);  // views of extents the peer no longer offers go when their last copy ends
}

std::shared_ptr<ShmPath::View> ShmPath::mapped_locked(uint64_t addr, uint64_t len, uint8_t** at) {
  auto it = maps_.upper_bound(addr);
  if (it == maps_.begin()) return nullptr;
  --it;
  Mapping& m = it->second;
  if (addr - m.ext.addr > m.ext.len || len > m.ext.len - (addr - m.ext.addr)) return nullptr;
  if (m.failed) return nullptr;
  if (!m.view) {
    std::string path = "/proc/" + std::to_string(pid_) + "/fd/" + std::to_string(m.ext.fd);
    int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) {
      log::info("shm: cannot open " + path + " (" + errno_str(errno) + "); using cross-memory attach for it");
      m.failed = true;
      return nullptr;
    }
    const uint64_t page = uint64_t(::sysconf(_SC_PAGESIZE));
    uint64_t start = m.ext.offset & ~(page - 1);
    size_t map_len = size_t(m.ext.offset - start + m.ext.len);
    void* p = ::mmap(nullptr, map_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, off_t(start));
    ::close(fd);
    if (p == MAP_FAILED) {
      log::info("shm: mmap of " + path + " failed (" + errno_str(errno) + "); using cross-memory attach for it");
      m.failed = true;
      return nullptr;
    }
    auto v = std::make_shared<View>();
    v->base = static_cast<uint8_t*>(p);
    v->len = map_len;
    v->at = v->base + (m.ext.offset - start);
    m.view = std::move(v);
  }
  *at = m.view->at + (addr - m.ext.addr);
  return m.view;
}

Result ShmPath::execute(Op op, const std::vector<Desc>& descs, Clock::time_point deadline) {
  struct Iovs {
    std::vector<iovec> l, r;
    std::vector<uint32_t> held;
  };
  thread_local Iovs t_iovs;  // reused: no allocation per request
  // One look-up of the thread's storage (each use of a thread_local in a shared object is a call).
  Iovs& t = t_iovs;
  t.l.clear();
  t.r.clear();
  t.held.clear();
  Result r = copy(op, descs, deadline, &t.l, &t.r, &t.held);
  leave_all(&t.held);
  return r;
}

Result ShmPath::copy(Op op, const std::vector<Desc>& descs, Clock::time_point deadline, std::vector<iovec>* liovp,
                     std::vector<iovec>* riovp, std::vector<uint32_t>* held) {
  const bool write = op == Op::kWrite;
  std::vector<iovec>& liov = *liovp;
  std::vector<iovec>& riov = *riovp;
  uint64_t batch_bytes = 0;
  bool used_mapping = false;  // a copy into a mapping succeeds even after the peer exited: check then
  auto flush = [&]() -> std::string {
    // One syscall for up to kMaxIov pieces; a short transfer continues where it stopped.
    size_t li = 0, ri = 0;
    while (li < liov.size()) {
      ssize_t n = write ? ::process_vm_writev(pid_, &liov[li], liov.size() - li, &riov[ri], riov.size() - ri, 0)
                        : ::process_vm_readv(pid_, &liov[li], liov.size() - li, &riov[ri], riov.size() - ri, 0);
      if (n < 0) {
        if (errno == EINTR) continue;
        return CallDesc(write ? "process_vm_writev" : "process_vm_readv").arg("pid", pid_).arg("iovs", liov.size() - li)
                   .hex("remote", uint64_t(reinterpret_cast<uintptr_t>(riov[ri].iov_base))).str() + ": " +
               cma_error(errno, pid_);
      }
      if (n == 0) return "process_vm: no progress (peer range unmapped?)";
      size_t left = size_t(n);
      while (left && li < liov.size()) {  // local and remote pieces have equal lengths pairwise
        size_t k = std::min(left, liov[li].iov_len);
        liov[li].iov_base = static_cast<uint8_t*>(liov[li].iov_base) + k;
        liov[li].iov_len -= k;
        riov[ri].iov_base = static_cast<uint8_t*>(riov[ri].iov_base) + k;
        riov[ri].iov_len -= k;
        left -= k;
        if (liov[li].iov_len == 0) ++li, ++ri;
      }
    }
    liov.clear();
    riov.clear();
    batch_bytes = 0;
    return {};  // (not "": that constructs from a char* with strlen, ~60 instructions per request)
  };
  auto checkpoint = [&]() -> std::optional<Result> {
    if (closed()) return Result{Status::kFailed, "shm path to " + peer_ + " closed during the request"};
    if (Clock::now() >= deadline)
      return Result{Status::kTimeout, "shm request to " + peer_ + " passed its deadline (the rest was not copied)"};
    return std::nullopt;
  };
  for (const Desc& d : descs) {
    for (uint64_t off = 0; off < d.length;) {
      uint64_t n = std::min(kChunk, d.length - off);
      auto* local = reinterpret_cast<uint8_t*>(d.local_addr + off);
      uint64_t remote = d.remote_addr + off;
      uint8_t* m = nullptr;
      uint32_t slot = kNoFence, tag = 0;
      std::shared_ptr<View> view;
      if (!locate(remote, n, &slot, &tag, &view, &m) || !enter(slot, tag, held))
        return {Status::kFailed, CallDesc("shm copy").arg("peer", peer_).hex("remote", remote).arg("len", n).str() +
                                     ": the peer deregistered that memory (nothing more of this request moved)"};
      if (view) {
        used_mapping = true;
        if (!liov.empty())
          if (auto err = flush(); !err.empty()) return {Status::kFailed, err};
        if (write)
          std::memcpy(m, local, n);
        else
          std::memcpy(local, m, n);
      } else {
        liov.push_back({local, size_t(n)});
        riov.push_back({reinterpret_cast<void*>(remote), size_t(n)});
        batch_bytes += n;
        if (liov.size() == size_t(kMaxIov) || batch_bytes >= kChunk)
          if (auto err = flush(); !err.empty()) return {Status::kFailed, err};
      }
      off += n;
      if (n == kChunk && liov.empty()) leave_all(held);  // a deregistration waits for one chunk at most
      if (n == kChunk || batch_bytes == 0)
        if (auto stop = checkpoint()) return *stop;
    }
  }
  if (!liov.empty())
    if (auto err = flush(); !err.empty()) return {Status::kFailed, err};
  // Cross-memory attach itself fails (ESRCH) once the peer is gone; a mapping does not.
  if (used_mapping && !peer_alive()) return {Status::kFailed, "peer process " + std::to_string(pid_) + " (" + peer_ + ") exited"};
  return Result(Status::kCompleted);
}

}  // namespace hixl::transport
