// AMX loop of `moekit peak` (compiled with -mamx-tile -mamx-bf16). Called only where the
// CPU has AMX-BF16, the OS saves tile state and this process was granted it
// (moekit::amx_permitted), so that an AMX host's bf16 ceiling is not read off the vector units:
// a ceiling that reads low would flatter every "% of ceiling" figure.
#include <immintrin.h>

#include <cstdint>

#include "peak.h"

namespace moekit::tools {

namespace kernels {
namespace {

// ldtilecfg's 64-byte operand, palette 1.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace

// tdpbf16ps: a 16 x 32 bf16 tile times a 32 x 16 one (pairs interleaved) into 16 x 16 f32,
// 16·16·32 products + adds = 16384 FLOPs. Six accumulators (of the eight tiles; the operands
// of one tdpbf16ps must be three different tiles) hide the instruction's latency; no loads in
// the loop, like the register-resident vector loops.
double dot_bf16_amx(int64_t iterations) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.bytes_per_row[t] = 64;
  }
  _tile_loadconfig(&cfg);
  alignas(64) uint16_t operand[16 * 32];
  for (uint16_t& v : operand) v = 0x3380;  // bf16 2^-24: sums stay finite
  alignas(64) float out[16 * 16];
  _tile_loadd(6, operand, 64);
  _tile_loadd(7, operand, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_zero(4);
  _tile_zero(5);
  for (int64_t it = 0; it < iterations; ++it) {
    _tile_dpbf16ps(0, 6, 7);
    _tile_dpbf16ps(1, 6, 7);
    _tile_dpbf16ps(2, 6, 7);
    _tile_dpbf16ps(3, 6, 7);
    _tile_dpbf16ps(4, 6, 7);
    _tile_dpbf16ps(5, 6, 7);
  }
  _tile_stored(0, out, 64);
  _tile_release();
  volatile float sink = out[0];
  (void)sink;
  return static_cast<double>(iterations) * 6 * 16 * 16 * 32 * 2;
}

}  // namespace kernels
}  // namespace moekit::tools
