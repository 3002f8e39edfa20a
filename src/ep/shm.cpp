#include "ep/shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "core/check.h"

namespace moekit::ep::detail {
namespace {

[[noreturn]] void fail_errno(const char* what, const std::string& name, int err) {
  moekit::detail::fail("ep::Buffer", "shared memory " + name, std::string(what) + " to succeed",
                       std::strerror(err));
}

std::string mib_str(uint64_t bytes) {
  char s[32];
  std::snprintf(s, sizeof s, "%.1f MiB", static_cast<double>(bytes) / (1 << 20));
  return s;
}

// "Room for N bytes in /dev/shm" as an Error: what a segment that cannot get its pages raises.
[[noreturn]] void fail_room(const std::string& name, size_t bytes, int err, const char* how) {
  std::string free = "unknown";
  struct statvfs st {};
  if (::statvfs("/dev/shm", &st) == 0)
    free = std::to_string(static_cast<uint64_t>(st.f_bavail) * st.f_frsize) + " bytes free of " +
           std::to_string(static_cast<uint64_t>(st.f_blocks) * st.f_frsize);
  const std::string needed = std::to_string(bytes) + " bytes (" + mib_str(bytes) + ")";
  const std::string actual = std::string(how) + ": " + (err ? std::strerror(err) : "not enough free space") + " (" + free + ")";
  if (err == 0 || err == ENOSPC || err == EFBIG || err == EFAULT || err == ENOMEM)
    moekit::detail::fail("ep::Buffer", "shared memory " + name,
                         "room for " + needed + " in /dev/shm (it is too small: give it more room, e.g. Docker's "
                         "--shm-size or a larger tmpfs, or ask for fewer num_nvl_bytes / num_rdma_bytes)",
                         actual);
  moekit::detail::fail("ep::Buffer", "shared memory " + name, "to reserve " + needed + " in /dev/shm", actual);
}

// Takes every page of a freshly created segment, mapped at data with the huge-page advice
// given. ftruncate only sets the size: on tmpfs a page is taken when first written, and a
// write past the mount's free space is a SIGBUS, not an error. So:
//  - a segment larger than the mount's free space is refused before any page is taken (so a
//    failing segment never fills /dev/shm under its neighbours);
//  - MADV_POPULATE_WRITE then takes the pages through the mapping, which keeps the huge-page
//    advice (on a `huge=advise` mount posix_fallocate, which has no mapping, takes 4 KiB pages)
//    and reports a failure (EFAULT) where a write would raise SIGBUS;
//  - kernels without it (before 5.14) reserve with posix_fallocate.
// Returns whether the pages are also mapped (populated): then writes never fault.
bool reserve(char* data, size_t bytes, const std::string& name) {
  if (bytes == 0) return true;
  struct statvfs st {};
  if (::statvfs("/dev/shm", &st) == 0 && st.f_blocks > 0 &&
      static_cast<uint64_t>(st.f_bavail) * st.f_frsize < bytes)
    fail_room(name, bytes, 0, "statvfs(/dev/shm)");
#ifdef MADV_POPULATE_WRITE
  if (::madvise(data, bytes, MADV_POPULATE_WRITE) == 0) return true;
  if (errno != EINVAL) fail_room(name, bytes, errno, "madvise(MADV_POPULATE_WRITE)");
#endif
  const int fd = ::shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) fail_errno("shm_open(reserve)", name, errno);
  int err = 0;
  do {
    err = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  } while (err == EINTR);
  ::close(fd);
  if (err != 0) fail_room(name, bytes, err, "posix_fallocate");
  return false;
}

// Maps the segment, asking for transparent huge pages before any page is touched
// (populate: map every page afterwards, as MAP_POPULATE would). They take effect where the
// shared-memory mount allows them (`/dev/shm` mounted with huge=within_size, advise or
// always); elsewhere the advice does nothing.
char* map_fd(int fd, size_t bytes, bool populate, const std::string& name) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);
  if (p == MAP_FAILED) fail_errno("mmap", name, err);
#ifdef MADV_HUGEPAGE
  ::madvise(p, bytes, MADV_HUGEPAGE);  // (advice: failure is harmless)
#endif
  if (populate) {
#ifdef MADV_POPULATE_READ
    if (::madvise(p, bytes, MADV_POPULATE_READ) == 0) return static_cast<char*>(p);
#endif
    const volatile char* c = static_cast<const char*>(p);
    for (size_t i = 0; i < bytes; i += 4096) (void)c[i];
  }
  return static_cast<char*>(p);
}

// Whether the mapping that starts at p maps any of its memory with 2 MiB pages
// (/proc/self/smaps: ShmemPmdMapped of that mapping).
bool huge_pages_at(const void* p) {
  std::ifstream smaps("/proc/self/smaps");
  char start[32];
  std::snprintf(start, sizeof start, "%lx-", static_cast<unsigned long>(reinterpret_cast<uintptr_t>(p)));
  bool inside = false;
  for (std::string line; std::getline(smaps, line);) {
    const bool header = !line.empty() && std::isxdigit(static_cast<unsigned char>(line[0])) && line.find('-') < line.find(' ');
    if (header) {
      if (inside) return false;
      inside = line.rfind(start, 0) == 0;
    } else if (inside && line.rfind("ShmemPmdMapped:", 0) == 0) {
      return std::strtol(line.c_str() + 15, nullptr, 10) > 0;
    }
  }
  return false;
}

}  // namespace

std::shared_ptr<Mapping> Mapping::create(const std::string& name, size_t bytes, bool touch) {
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) fail_errno("shm_open(create)", name, errno);
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    ::close(fd);
    ::shm_unlink(name.c_str());
    fail_errno("ftruncate", name, err);
  }
  char* data = nullptr;
  try {
    data = map_fd(fd, bytes, false, name);
  } catch (...) {
    ::shm_unlink(name.c_str());
    throw;
  }
  bool populated = false;
  try {
    populated = reserve(data, bytes, name);
  } catch (...) {
    ::munmap(data, bytes);
    ::shm_unlink(name.c_str());
    throw;
  }
  // Touching every page now allocates it, so copies from peers never take the first-touch
  // fault on the critical path.
  if (touch && !populated) std::memset(data, 0, bytes);
  auto m = std::shared_ptr<Mapping>(new Mapping(name, data, bytes, true));
  m->huge_ = touch && huge_pages_at(data);
  return m;
}

std::shared_ptr<Mapping> Mapping::open(const std::string& name, bool populate) {
  const int fd = ::shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) fail_errno("shm_open(open)", name, errno);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    fail_errno("fstat", name, err);
  }
  const size_t bytes = static_cast<size_t>(st.st_size);
  char* data = map_fd(fd, bytes, populate, name);
  auto m = std::shared_ptr<Mapping>(new Mapping(name, data, bytes, false));
  m->linked_ = false;  // the creator owns the name
  return m;
}

void Mapping::unlink() {
  if (owner_ && linked_) ::shm_unlink(name_.c_str());
  linked_ = false;
}

Mapping::~Mapping() {
  unlink();
  ::munmap(data_, bytes_);
}

}  // namespace moekit::ep::detail
