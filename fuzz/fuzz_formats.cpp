// Fuzz target for the formats component: arbitrary shapes, dtypes, strides, granularities
// and payload bytes go through the public casts. Every call must either succeed or throw
// moekit::Error (never crash, never write out of bounds: build with sanitizers), and the
// vectorised paths must agree bit for bit with the portable path.
//
// With libFuzzer (clang, -DMOEKIT_FUZZ=ON) this is a coverage-guided fuzzer; in the normal
// build a small driver feeds it pseudo-random inputs (ctest: fuzz_formats_smoke).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "moekit/moekit.h"
#include "reference.h"
#include "smoke_driver.h"

namespace {

using namespace moekit;

using moekit::fuzzing::Reader;

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && std::memcmp(a.data(), b.data(), static_cast<size_t>(a.numel()) * a.element_size()) == 0;
}

// Runs fn under the portable path and every other supported ISA; outputs must match.
template <class Fn>
void differential(Fn fn) {
  Tensor want;
  {
    ScopedIsa portable(Isa::scalar);
    want = fn();
  }
  for (Isa isa : {Isa::avx2, Isa::avx512}) {
    if (!isa_supported(isa)) continue;
    ScopedIsa scoped(isa);
    if (!same_bytes(fn(), want)) {
      std::fprintf(stderr, "fuzz: %s path differs from the portable path\n", isa_name(isa));
      std::abort();
    }
  }
}

// Values and scales must equal the oracle's bit for bit (NaN scales compare as NaN).
void check_oracle(const Quantized& got, const Quantized& want) {
  if (!same_bytes(got.values, want.values)) {
    std::fprintf(stderr, "fuzz: cast values differ from the oracle\n");
    std::abort();
  }
  for (int64_t i = 0; i < got.sf.numel(); ++i) {
    const float a = got.sf.data_ptr<float>()[i], b = want.sf.data_ptr<float>()[i];
    if (!(a == b || (a != a && b != b))) {
      std::fprintf(stderr, "fuzz: scale %ld differs from the oracle: %g vs %g\n", static_cast<long>(i), a, b);
      std::abort();
    }
  }
}

void run_one(Reader& in) {
  const DType wide = in.byte() & 1 ? DType::bf16 : DType::f32;
  const int64_t rows = in.small(9), cols = in.small(200);
  const int64_t pad = in.small(5);  // row stride = cols + pad: strided views
  const int64_t gran = in.small(140) - 2;  // may be 0 or negative: must raise Error
  const bool ue8m0 = in.byte() & 1;
  const int op = static_cast<int>(in.small(6));
  if (std::getenv("MOEKIT_FUZZ_TRACE")) std::fprintf(stderr, "op %d wide %d rows %ld cols %ld pad %ld gran %ld ue8m0 %d\n", op, wide == DType::bf16, (long)rows, (long)cols, (long)pad, (long)gran, ue8m0);
  std::vector<uint8_t> storage(static_cast<size_t>((rows * (cols + pad) + 16) * 4));
  for (uint8_t& b : storage) b = in.byte();
  const Tensor x = Tensor::from_blob(storage.data(), {rows, cols}, wide, Device::cpu(), {cols + pad, 1});
  try {
    switch (op) {
      // Casts: every ISA agrees with the portable path, which agrees with the f64 oracle.
      case 0: differential([&] { return per_token_cast_to_fp8(x, ue8m0, gran).values; }); check_oracle(per_token_cast_to_fp8(x, ue8m0, gran), ref::per_token_cast_to_fp8(x, ue8m0, gran)); break;
      case 1: differential([&] { return per_token_cast_to_fp4(x, ue8m0, gran).values; }); check_oracle(per_token_cast_to_fp4(x, ue8m0, gran), ref::per_token_cast_to_fp4(x, ue8m0, gran)); break;
      case 2: differential([&] { return per_block_cast_to_fp8(x, ue8m0, gran, gran + 1).values; }); check_oracle(per_block_cast_to_fp8(x, ue8m0, gran, gran + 1), ref::per_block_cast_to_fp8(x, ue8m0, gran, gran + 1)); break;
      case 3: differential([&] { return per_channel_cast_to_fp8(x, ue8m0, gran).values; }); check_oracle(per_channel_cast_to_fp8(x, ue8m0, gran), ref::per_channel_cast_to_fp8(x, ue8m0, gran)); break;
      case 4: {  // decode arbitrary codes with arbitrary (finite) scales
        const Tensor q = Tensor::from_blob(storage.data(), {rows, cols}, DType::e4m3, Device::cpu(), {cols + pad, 1});
        const int64_t g = gran <= 0 ? 1 : gran;
        Tensor sf = Tensor::empty({rows, (cols + g - 1) / g}, DType::f32);
        for (int64_t i = 0; i < sf.numel(); ++i) sf.data_ptr<float>()[i] = static_cast<float>(in.small(100)) * 0.25f;
        differential([&] { return cast_back_from_fp8(q, sf, wide, 1, gran); });
        break;
      }
      default: {
        const Tensor codes = Tensor::from_blob(storage.data(), {rows, cols}, DType::e4m3);
        differential([&] {
          Tensor out = Tensor::empty({rows, cols}, wide);
          convert(codes, out);
          return out;
        });
      }
    }
  } catch (const Error&) {
    // Bad arguments are allowed to be rejected; anything else escapes and fails.
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Reader in{data, size};
  run_one(in);
  return 0;
}

#ifndef MOEKIT_LIBFUZZER
// Smoke driver: deterministic pseudo-random inputs (argv[1] = iterations).
int main(int argc, char** argv) {
  const long iterations = argc > 1 ? std::strtol(argv[1], nullptr, 10) : 2000;
  moekit::fuzzing::run_smoke(iterations, 0x9e3779b97f4a7c15ull, 16, 1, 4000);
  return 0;
}
#endif
