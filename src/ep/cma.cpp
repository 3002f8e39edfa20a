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

bool read_peer_rows(pid_t pid, uint64_t remote, int64_t stride, int64_t rows, size_t row_bytes, char* local) {
  if (rows <= 0 || row_bytes == 0) return true;
  if (stride == static_cast<int64_t>(row_bytes)) return read_run(pid, remote, static_cast<size_t>(rows) * row_bytes, local);
  // Strided rows: up to IOV_MAX of them per call; a short call resumes row by row.
  const int64_t per_call = std::min<int64_t>(IOV_MAX, 1024);
  std::vector<iovec> from(static_cast<size_t>(std::min(rows, per_call)));
  for (int64_t r0 = 0; r0 < rows; r0 += per_call) {
    const int64_t n = std::min(per_call, rows - r0);
    for (int64_t r = 0; r < n; ++r)
      from[static_cast<size_t>(r)] = {reinterpret_cast<void*>(remote + static_cast<uint64_t>((r0 + r) * stride)), row_bytes};
    const size_t want = static_cast<size_t>(n) * row_bytes;
    char* to_at = local + static_cast<size_t>(r0) * row_bytes;
    iovec to{to_at, want};
    ssize_t got;
    do got = ::process_vm_readv(pid, &to, 1, from.data(), static_cast<unsigned long>(n), 0);
    while (got < 0 && errno == EINTR);
    if (got < 0) return false;
    if (static_cast<size_t>(got) == want) continue;
    for (int64_t r = static_cast<int64_t>(got) / static_cast<int64_t>(row_bytes); r < n; ++r)
      if (!read_run(pid, remote + static_cast<uint64_t>((r0 + r) * stride), row_bytes, to_at + static_cast<size_t>(r) * row_bytes))
        return false;
  }
  return true;
}

}  // namespace moekit::ep::detail
