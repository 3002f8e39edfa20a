// CPU feature detection, instruction-set dispatch and threading controls.
#pragma once

#include <string>

#include "moekit/error.h"

namespace moekit {

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512bf16 = false, avx512vnni = false, avx512vbmi = false;
  bool gfni = false;  // Galois-field affine byte transforms (used in their 512-bit form only)
  bool os_saves_zmm = false, os_saves_ymm = false;
  // AMX tiles with bf16 dot products, and an OS that saves tile state (XCR0 bits 17-18; Linux
  // still wants a per-process request, arch_prctl ARCH_REQ_XCOMP_PERM, before first use).
  // The GEMMs use it under Isa::amx; `moekit peak` measures it as a bf16 ceiling.
  bool amx_bf16 = false, os_saves_tiles = false;
};

// Detected once (cpuid + xgetbv, so a hypervisor that hides ZMM state is respected).
const CpuFeatures& cpu_features();

// The instruction-set levels moekit has kernels for, in increasing order.
//   avx2   = AVX2 + FMA + F16C
//   avx512 = AVX-512 F/BW/VL/DQ (kernels use BF16/VNNI/VBMI only when those bits are set)
//   avx512_bf16 = avx512 + AVX512_BF16 (vdpbf16ps): the GEMMs multiply bf16 pairs
//            (AMD Zen 4/5 and other CPUs without AMX); every other component runs its
//            avx512 kernels.
//   amx    = avx512 + AMX-BF16 tiles, granted to this process by the OS. Only the GEMMs
//            have AMX kernels (every other component runs its avx512 kernels).
// The GEMMs of avx512_bf16 and amx have their own accuracy class: results are
// bit-identical across runs and thread counts, but not to the scalar/avx2/avx512 bits
// (vdpbf16ps / tdpbf16ps sum pairs of products inside the instruction; docs/GEMM.md).
enum class Isa { scalar = 0, avx2 = 1, avx512 = 2, avx512_bf16 = 3, amx = 4 };
const char* isa_name(Isa isa);
Isa parse_isa(const std::string& name);  // Error on unknown names
bool isa_supported(Isa isa);
// AMX tile data granted to this process (asks Linux once, arch_prctl ARCH_REQ_XCOMP_PERM);
// false on CPUs without AMX-BF16.
bool amx_permitted();
Isa best_supported_isa();

// The level kernels dispatch to: MOEKIT_ISA=scalar|avx2|avx512|avx512_bf16|amx if set (Error
// if this CPU lacks it), else the best supported. set_active_isa overrides it for the process (tests
// use it to run every path); ScopedIsa restores the previous choice.
Isa active_isa();
void set_active_isa(Isa isa);

class ScopedIsa {
 public:
  explicit ScopedIsa(Isa isa) : previous_(active_isa()) { set_active_isa(isa); }
  ~ScopedIsa() { set_active_isa(previous_); }
  ScopedIsa(const ScopedIsa&) = delete;
  ScopedIsa& operator=(const ScopedIsa&) = delete;

 private:
  Isa previous_;
};

// Threads used by moekit's parallel kernels: MOEKIT_NUM_THREADS if set, else OpenMP's
// default. Results never depend on this number (work is split so that every output
// element is computed by the same sequence of operations whatever the thread count).
int num_threads();
void set_num_threads(int n);

// CUDA devices this process can use: 0 when moekit was built without MOEKIT_CUDA, when
// no driver is loaded, or when no GPU is visible (never an Error).
int cuda_device_count();

}  // namespace moekit
