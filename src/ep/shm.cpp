#include "ep/shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/check.h"

namespace moekit::ep::detail {
namespace {

[[noreturn]] void fail_errno(const char* what, const std::string& name, int err) {
  moekit::detail::fail("ep::Buffer", "shared memory " + name, std::string(what) + " to succeed",
                       std::strerror(err));
}

char* map_fd(int fd, size_t bytes, int extra_flags, const std::string& name) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | extra_flags, fd, 0);
  const int err = errno;
  ::close(fd);
  if (p == MAP_FAILED) fail_errno("mmap", name, err);
  return static_cast<char*>(p);
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
    data = map_fd(fd, bytes, 0, name);
  } catch (...) {
    ::shm_unlink(name.c_str());
    throw;
  }
  // Touching every page now allocates it, so copies from peers never take the first-touch
  // fault on the critical path.
  if (touch) std::memset(data, 0, bytes);
  return std::shared_ptr<Mapping>(new Mapping(name, data, bytes, true));
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
  char* data = map_fd(fd, bytes, populate ? MAP_POPULATE : 0, name);
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
