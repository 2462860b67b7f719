// Does the AMX tile work of a 16-row int8 block overlap the AVX-512 float scaling that follows it? One core, data in
// L1, cycles per block (TSC) for: the tile part alone (zero C, load A [16 x 32 bytes] and B [8 x 64], tdpbssd, store
// C), the scaling alone (16 rows: cvt, mul, fma, fma - the int8 kernel's per-block epilogue), and the two together
// with and without a dependency between them.
//
//   g++ -O2 -mamx-tile -mamx-int8 -mavx512f -mf16c docs/results/session19/amx_overlap_bench.cpp -o /tmp/amx_overlap
//   /tmp/amx_overlap
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <x86intrin.h>

#include <cstdint>
#include <cstdio>
#include <cstring>

struct alignas(64) Config {
  uint8_t palette, start, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
alignas(64) int8_t A[16 * 1024];
alignas(64) int8_t B[64 * 512];
alignas(64) int32_t C[8][256], D[8][256];
float dx[16 * 64], sx[16 * 64];
alignas(64) uint16_t dw[64 * 32];
__m512 acc[16];

template <bool FromMemory>
static inline void scale(const int32_t* sums, int b) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dw + b * 32)));
  const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dw + b * 32 + 16)));
#pragma GCC unroll 16
  for (int r = 0; r < 16; r++) {
    const __m512 s = FromMemory ? _mm512_cvtepi32_ps(_mm512_load_si512(sums + 16 * r))
                                : _mm512_cvtepi32_ps(_mm512_set1_epi32(r + b));
    acc[r] = _mm512_fmadd_ps(s, _mm512_mul_ps(d, _mm512_set1_ps(dx[r * 32 + b])), acc[r]);
    acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[r * 32 + b]), acc[r]);
  }
}

#define TWO_BLOCKS(b)                                                                                              \
  _tile_zero(0); _tile_loadd(4, A + (b) * 32, 1024); _tile_loadd(6, B + (b) * 512, 64); _tile_dpbssd(0, 4, 6);   \
  _tile_zero(1); _tile_loadd(5, A + (b) * 32 + 32, 1024); _tile_loadd(7, B + (b) * 512 + 512, 64);               \
  _tile_dpbssd(1, 5, 7);

int main() {
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return std::printf("no AMX permission\n"), 1;
  Config c;
  std::memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t = 0; t < 4; t++) c.rows[t] = 16, c.colsb[t] = 64;
  for (int t = 4; t < 6; t++) c.rows[t] = 16, c.colsb[t] = 32;
  for (int t = 6; t < 8; t++) c.rows[t] = 8, c.colsb[t] = 64;
  _tile_loadconfig(&c);
  const int n = 100000;
  const char* names[] = {"tile part only", "scaling only (sums from untouched memory)",
                         "both, scaling from untouched memory", "both, scaling from registers",
                         "both, scaling the sums just stored", "both, scaling the sums stored 2 passes before"};
  for (int mode = 0; mode < 6; ++mode) {
    for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
    const uint64_t t0 = __rdtsc();
    for (int i = 0; i < n; i += 2) {
      const int b = i % 32, p = (i / 2) % 4;
      if (mode != 1) {
        TWO_BLOCKS(b);
        _tile_stored(0, C[2 * p], 64);
        _tile_stored(1, C[2 * p + 1], 64);
      }
      if (mode == 1 || mode == 2) scale<true>(D[0], b), scale<true>(D[1], b + 1);
      if (mode == 3) scale<false>(D[0], b), scale<false>(D[1], b + 1);
      if (mode == 4) scale<true>(C[2 * p], b), scale<true>(C[2 * p + 1], b + 1);
      if (mode == 5) scale<true>(C[2 * ((p + 2) % 4)], b), scale<true>(C[2 * ((p + 2) % 4) + 1], b + 1);
    }
    const uint64_t t1 = __rdtsc();
    float s = 0;
    for (int r = 0; r < 16; r++) s += _mm512_reduce_add_ps(acc[r]);
    std::printf("%-48s %5.1f TSC cycles a block (%g)\n", names[mode], double(t1 - t0) / n, s);
  }
  _tile_release();
}
