// The int8 kernel's AMX path (Intel AMX-INT8) for Q8_0 weights: where the CPU has it, passes of several rows (a
// verification's LM head, a batched step, a prefill) run each (16 rows, block of 32 k, panel of 16 outputs) integer
// product as one tile multiply instead of 8 dot instructions per row. What remains per row is the per-block float
// scaling - the same sequence as the other paths, acc = fma(float(sum), d_w * d_x, acc) - and the integer sums are
// exact on every path, so a row's result keeps its bits whichever path and tile ran it.
//
// Tiles (palette 1): C0, C1 = 16 rows x 16 int32 (two blocks in flight), A0, A1 = 16 rows x 32 activation bytes,
// B0, B1 = 8 rows x 64 bytes: row g holds the 16 outputs' weights for k = 4g .. 4g + 3, 4 bytes per output - the
// packed Q8_0 block's own layout, loaded in place.
//
// Why only Q8_0: Q4_1's nibbles must be widened to bytes in memory before a tile load, and with that the AMX pass was
// never faster than the AVX512-VNNI one (1.4-1.8x slower at 2-4 rows, alike at 8-32, 1.16-1.20x slower at 64-256
// once the VNNI path prefetched; docs/notes.md: int8_tried_and_dropped.txt). On an AMX Xeon the tile
// instructions and the AVX-512 scaling do not overlap (a 16-row block: ~31-36 cycles of tile work, then ~46 of
// scaling; amx_overlap_bench.cpp there), so the tile path gains only what it saves of the dot instructions.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <array>
#include <utility>

#include "int8_linear.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512vnni,amx-tile,amx-int8")

namespace adaflash::int8::amx {
namespace {

constexpr int kTileRows = 16;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

const TileConfig& config() {
  static const TileConfig cfg = [] {
    TileConfig c;
    for (int t = 0; t < 2; ++t) c.rows[t] = kTileRows, c.colsb[t] = 64;         // C
    for (int t = 2; t < 4; ++t) c.rows[t] = kTileRows, c.colsb[t] = kBlock;     // A
    for (int t = 4; t < 6; ++t) c.rows[t] = 8, c.colsb[t] = 64;                 // B
    return c;
  }();
  return cfg;
}

// C tile rows (int32 sums of one block) -> the R rows' accumulators.
template <int R>
inline void scale_block(const int32_t* sums, const uint8_t* blk, const Activations& a, int64_t r0, int64_t nb,
                        int64_t b, __m512* acc) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const __m512 s = _mm512_cvtepi32_ps(_mm512_load_si512(sums + r * kPanel));
    acc[r] = _mm512_fmadd_ps(s, _mm512_mul_ps(d, _mm512_set1_ps(a.d[(r0 + r) * nb + b])), acc[r]);
  }
}

// R (<= 16) rows from row r0 x one panel over all of k.
template <int R>
void tile(const Activations& a, int64_t r0, const uint8_t* panel, int64_t nb, const float* bias, float* y,
          int64_t ldy, const uint8_t* end) {
  const int64_t k = nb * kBlock;
  alignas(64) int32_t sums[2][kTileRows * kPanel];
  __m512 acc[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int8_t* x = a.q + r0 * k;
  const uint8_t* weights = panel + 32;  // each block's weights after its 16 scales: the B tile
  int64_t b = 0;
  for (; b + 1 < nb; b += 2) {  // two blocks a pass: the second's multiply runs while the first is scaled
    if (r0 == 0) prefetch_ahead<_MM_HINT_T1>(panel + b * kQ8_0Packed, 2 * kQ8_0Packed, end);
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(2, x + b * kBlock, k);
    _tile_loadd(3, x + (b + 1) * kBlock, k);
    _tile_loadd(4, weights + b * kQ8_0Packed, 64);
    _tile_loadd(5, weights + (b + 1) * kQ8_0Packed, 64);
    _tile_dpbssd(0, 2, 4);
    _tile_dpbssd(1, 3, 5);
    _tile_stored(0, sums[0], kPanel * 4);
    _tile_stored(1, sums[1], kPanel * 4);
    scale_block<R>(sums[0], panel + b * kQ8_0Packed, a, r0, nb, b, acc);
    scale_block<R>(sums[1], panel + (b + 1) * kQ8_0Packed, a, r0, nb, b + 1, acc);
  }
  if (b < nb) {
    _tile_zero(0);
    _tile_loadd(2, x + b * kBlock, k);
    _tile_loadd(4, weights + b * kQ8_0Packed, 64);
    _tile_dpbssd(0, 2, 4);
    _tile_stored(0, sums[0], kPanel * 4);
    scale_block<R>(sums[0], panel + b * kQ8_0Packed, a, r0, nb, b, acc);
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const __m512 out = bias ? _mm512_add_ps(acc[r], _mm512_loadu_ps(bias)) : acc[r];
    _mm512_storeu_ps(y + (r0 + r) * ldy, out);
  }
}

using Tile = void (*)(const Activations&, int64_t, const uint8_t*, int64_t, const float*, float*, int64_t,
                      const uint8_t*);

template <int... R>
constexpr std::array<Tile, sizeof...(R)> tiles(std::integer_sequence<int, R...>) {
  return {tile<R + 1>...};
}

// A panel for all m rows in 16-row tiles (the last one's padding rows are multiplied and dropped: the scratch keeps
// kPadRows rows after the last).
void panel_rows(const Activations& a, int64_t m, const uint8_t* panel, int64_t nb, const float* bias, float* y,
                int64_t ldy, const uint8_t* end) {
  static constexpr auto table = tiles(std::make_integer_sequence<int, kTileRows>{});
  for (int64_t r0 = 0; r0 < m; r0 += kTileRows)
    table[(m - r0 < kTileRows ? m - r0 : kTileRows) - 1](a, r0, panel, nb, bias, y, ldy, end);
}

}  // namespace

bool available() {
  static const bool yes = [] {
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-int8")) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // Linux asks a process to opt in to AMX state
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return yes;
}

void begin() { _tile_loadconfig(&config()); }
void end() { _tile_release(); }

const PanelRows kQ8_0Rows = panel_rows;

}  // namespace adaflash::int8::amx

#pragma GCC pop_options
