// POSIX shared-memory segments for the EP buffers: created by one rank, mapped by every rank
// of its node. A mapping stays valid after the name is unlinked, so a segment's name is
// removed as soon as every peer has mapped it (nothing is left in /dev/shm if a rank dies
// later), and the memory lives for as long as any shared_ptr to the mapping does.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace moekit::ep::detail {

class Mapping {
 public:
  // Creates name (exclusive), sizes it, maps it and takes every page (MADV_POPULATE_WRITE
  // through the huge-page-advised mapping; posix_fallocate on kernels before 5.14); touch =
  // make sure later copies into it never fault (populated pages already do not). Raises moekit::Error
  // (quoting the size) when /dev/shm cannot hold it, never leaving a mapping whose first
  // write past the free space would be a SIGBUS; the name is removed again on any failure.
  static std::shared_ptr<Mapping> create(const std::string& name, size_t bytes, bool touch);
  // Maps an existing segment created by a peer, whole (size from the file; pages populated
  // up front unless populate is false).
  static std::shared_ptr<Mapping> open(const std::string& name, bool populate = true);
  ~Mapping();
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;

  char* data() const { return data_; }
  size_t size() const { return bytes_; }
  const std::string& name() const { return name_; }
  // Removes the name (idempotent); the memory stays mapped.
  void unlink();
  // Whether a segment created with touch got 2 MiB pages (false for opened segments).
  bool huge() const { return huge_; }
  bool contains(const void* p, size_t n) const {
    const char* c = static_cast<const char*>(p);
    return c >= data_ && n <= bytes_ && c <= data_ + (bytes_ - n);
  }

 private:
  Mapping(std::string name, char* data, size_t bytes, bool owner)
      : name_(std::move(name)), data_(data), bytes_(bytes), owner_(owner) {}
  std::string name_;
  char* data_;
  size_t bytes_;
  bool owner_;
  bool linked_ = true;
  bool huge_ = false;
};

}  // namespace moekit::ep::detail
