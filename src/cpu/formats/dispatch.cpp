#include "format_kernels.h"

namespace moekit::detail {

const FormatKernels& format_kernels(Isa isa) {
  switch (isa) {
    case Isa::amx:  // no AMX or AVX512_BF16 kernels for the casts
    case Isa::avx512_bf16:
    case Isa::avx512: return format_kernels_avx512();
    case Isa::avx2: return format_kernels_avx2();
    case Isa::scalar: break;
  }
  return format_kernels_scalar();
}

}  // namespace moekit::detail
