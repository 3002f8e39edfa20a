#include "moekit/runtime.h"

#include <cpuid.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <string>

#include "check.h"
#include "device_memory.h"

namespace moekit {

namespace {

uint64_t read_xcr0() {
  uint32_t eax = 0, edx = 0;
  // xgetbv is only legal when the OS set OSXSAVE; the caller checks that first.
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

CpuFeatures detect() {
  CpuFeatures f;
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = c & (1u << 27);
  const bool avx = c & (1u << 28);
  f.fma = c & (1u << 12);
  f.f16c = c & (1u << 29);
  if (!osxsave || !avx) return f;
  const uint64_t xcr0 = read_xcr0();
  f.os_saves_ymm = (xcr0 & 0x6) == 0x6;
  f.os_saves_zmm = (xcr0 & 0xe6) == 0xe6;  // XMM, YMM, opmask, ZMM_Hi256, Hi16_ZMM
  if (__get_cpuid_max(0, nullptr) < 7) return f;
  __cpuid_count(7, 0, a, b, c, d);
  f.avx2 = f.os_saves_ymm && (b & (1u << 5));
  f.os_saves_tiles = (xcr0 & 0x60000) == 0x60000;  // XTILECFG, XTILEDATA
  f.amx_bf16 = f.os_saves_tiles && (d & (1u << 22)) && (d & (1u << 24));  // AMX-BF16, AMX-TILE
  if (f.os_saves_zmm) {
    f.avx512f = b & (1u << 16);
    f.avx512dq = b & (1u << 17);
    f.avx512bw = b & (1u << 30);
    f.avx512vl = b & (1u << 31);
    f.avx512vbmi = c & (1u << 1);
    f.avx512vnni = c & (1u << 11);
    f.gfni = c & (1u << 8);
    __cpuid_count(7, 1, a, b, c, d);
    f.avx512bf16 = a & (1u << 5);
  }
  if (!f.os_saves_ymm) f.fma = f.f16c = false;
  return f;
}

std::atomic<int> g_isa{-1};
std::atomic<int> g_threads{0};

Isa isa_from_environment() {
  const char* env = std::getenv("MOEKIT_ISA");
  if (env == nullptr || *env == '\0') return best_supported_isa();
  Isa requested = Isa::scalar;
  try {
    requested = parse_isa(env);
  } catch (const Error& e) {  // the environment's value is at fault, not a caller's argument
    detail::fail("active_isa", "MOEKIT_ISA", e.expected(), e.actual());
  }
  if (!isa_supported(requested))
    detail::fail("active_isa", "MOEKIT_ISA", "an instruction set this CPU supports (best: " +
                 std::string(isa_name(best_supported_isa())) + ")", env);
  return requested;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::scalar: return "scalar";
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512";
    case Isa::avx512_bf16: return "avx512_bf16";
    case Isa::amx: return "amx";
  }
  return "?";
}

Isa parse_isa(const std::string& name) {
  if (name == "scalar") return Isa::scalar;
  if (name == "avx2") return Isa::avx2;
  if (name == "avx512") return Isa::avx512;
  if (name == "avx512_bf16") return Isa::avx512_bf16;
  if (name == "amx") return Isa::amx;
  detail::fail("parse_isa", "name", "scalar, avx2, avx512, avx512_bf16 or amx", "\"" + name + "\"");
}

bool isa_supported(Isa isa) {
  const CpuFeatures& f = cpu_features();
  switch (isa) {
    case Isa::scalar: return true;
    case Isa::avx2: return f.avx2 && f.fma && f.f16c;
    case Isa::avx512: return f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && isa_supported(Isa::avx2);
    case Isa::avx512_bf16: return f.avx512bf16 && isa_supported(Isa::avx512);
    case Isa::amx: return f.amx_bf16 && isa_supported(Isa::avx512) && amx_permitted();
  }
  return false;
}

bool amx_permitted() {
  if (!cpu_features().amx_bf16) return false;
  // Linux keeps tile data disabled (XFD) until the process asks for it, once.
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}

Isa best_supported_isa() {
  if (isa_supported(Isa::amx)) return Isa::amx;
  if (isa_supported(Isa::avx512_bf16)) return Isa::avx512_bf16;
  if (isa_supported(Isa::avx512)) return Isa::avx512;
  if (isa_supported(Isa::avx2)) return Isa::avx2;
  return Isa::scalar;
}

Isa active_isa() {
  int v = g_isa.load(std::memory_order_relaxed);
  if (v < 0) {
    v = static_cast<int>(isa_from_environment());
    g_isa.store(v, std::memory_order_relaxed);
  }
  return static_cast<Isa>(v);
}

void set_active_isa(Isa isa) {
  if (!isa_supported(isa))
    detail::fail("set_active_isa", "isa", "an instruction set this CPU supports (best: " +
                 std::string(isa_name(best_supported_isa())) + ")", isa_name(isa));
  g_isa.store(static_cast<int>(isa), std::memory_order_relaxed);
}

int num_threads() {
  int n = g_threads.load(std::memory_order_relaxed);
  if (n > 0) return n;
  n = omp_get_max_threads();
  if (const char* env = std::getenv("MOEKIT_NUM_THREADS"); env && *env) {
    char* end = nullptr;
    const long v = std::strtol(env, &end, 10);
    if (*end != '\0' || v < 1 || v > 4096)
      detail::fail("num_threads", "MOEKIT_NUM_THREADS", "an integer in [1, 4096]", env);
    n = static_cast<int>(v);
  }
  g_threads.store(n, std::memory_order_relaxed);
  return n;
}

void set_num_threads(int n) {
  if (n < 1 || n > 4096) detail::fail("set_num_threads", "n", "an integer in [1, 4096]", std::to_string(n));
  g_threads.store(n, std::memory_order_relaxed);
}

int cuda_device_count() { return detail::cuda_device_count(); }

}  // namespace moekit
