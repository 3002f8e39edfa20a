#include "ep/cma.h"

#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <vector>

namespace moekit::ep::detail {

namespace {

// One contiguous run of bytes, resumed after short reads (the kernel may stop early, e.g.
// at a page it had to fault in on the peer's side).
bool read_run(pid_t pid, uint64_t remote, size_t bytes, char* local) {
  while (bytes > 0) {
    iovec to{local, bytes}, from{reinterpret_cast<void*>(remote), bytes};
    const ssize_t n = ::process_vm_readv(pid, &to, 1, &from, 1, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (n == 0) errno = EFAULT;
      return false;
    }
    local += n, remote += static_cast<uint64_t>(n), bytes -= static_cast<size_t>(n);
  }
  return true;
}

}  // namespace

bool read_peer_rows_at(pid_t pid, const uint64_t* from, int64_t rows, size_t row_bytes, char* local) {
  // Up to IOV_MAX rows per call; a short call resumes row by row.
  constexpr int64_t kPerCall = std::min<int64_t>(IOV_MAX, 1024);
  iovec remote[kPerCall];
  for (int64_t r0 = 0; r0 < rows; r0 += kPerCall) {
    const int64_t n = std::min(kPerCall, rows - r0);
    for (int64_t r = 0; r < n; ++r) remote[r] = {reinterpret_cast<void*>(from[r0 + r]), row_bytes};
    const size_t want = static_cast<size_t>(n) * row_bytes;
    char* to_at = local + static_cast<size_t>(r0) * row_bytes;
    iovec to{to_at, want};
    ssize_t got;
    do got = ::process_vm_readv(pid, &to, 1, remote, static_cast<unsigned long>(n), 0);
    while (got < 0 && errno == EINTR);
    if (got < 0) return false;
    if (static_cast<size_t>(got) == want) continue;
    for (int64_t r = static_cast<int64_t>(got) / static_cast<int64_t>(row_bytes); r < n; ++r)
      if (!read_run(pid, from[r0 + r], row_bytes, to_at + static_cast<size_t>(r) * row_bytes)) return false;
  }
  return true;
}

bool read_peer_rows(pid_t pid, uint64_t remote, int64_t stride, int64_t rows, size_t row_bytes, char* local) {
  if (rows <= 0 || row_bytes == 0) return true;
  if (stride == static_cast<int64_t>(row_bytes)) return read_run(pid, remote, static_cast<size_t>(rows) * row_bytes, local);
  std::vector<uint64_t> from(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) from[static_cast<size_t>(r)] = remote + static_cast<uint64_t>(r * stride);
  return read_peer_rows_at(pid, from.data(), rows, row_bytes, local);
}

}  // namespace moekit::ep::detail
