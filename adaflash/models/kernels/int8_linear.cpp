// y[m, n] = x[m, k] . W[n, k]^T over a GGUF's own blocks with 8-bit activations (Q4_1 / Q8_0 here, the other formats
// in kquant.cpp): llama.cpp's arithmetic, a numeric definition of the target (`--dtype int8`), never mixed with the
// fp32 one.
//
// Each row of x is rounded per 32 k (d = max|x| / 127, q = round-half-even(x / d)); a block's 32 products per output
// are an exact integer sum, scaled once per block. Why: the fp32 quantized kernel dequantizes every
// weight to a float and runs fp32 FMAs - bound by that arithmetic at one row (~30% of the bandwidth limit) and by
// the fp32 peak at 16 (a verification costs ~4.5 decode steps). The integer dot does 4 multiply-adds per byte lane
// (AVX512-VNNI dpbusd, or AVX2 maddubs + madd where the CPU lacks it - the same integers): fewer instructions per
// weight streamed at one row, ~4x the multiply-adds per instruction at many rows. Q8_0 passes of 8+ rows run their
// integer sums as AMX tile multiplies where the CPU has them (int8_amx.cpp; the same integers again).
//
// Packed per (panel of 16 outputs, block of 32 k), so one 64-byte load feeds a panel's lanes (32 bytes: half of them):
//   Q4_1: d[16] fp16, m[16] fp16, then [l = 0..3][half h][output j = 0..7][t = 0..3]: low nibble = w[8h + j][4l + t],
//         high nibble = w[8h + j][16 + 4l + t]                                                   (320 bytes)
//   Q8_0: d[16] fp16, then [s = 0..7][half h][output j][t]: int8 w[8h + j][4s + t]                (544 bytes)
#include <immintrin.h>
#include <omp.h>
#include <cstdint>
#include <cstring>
#include <vector>

#include "int8_linear.h"

namespace {

using namespace adaflash::int8;

// A tile of r rows from row r0 of one panel: (a, r0, panel, nb, bias, y, ldy, end).
using Tile = void (*)(const Activations&, int64_t, const uint8_t*, int64_t, const float*, float*, int64_t,
                      const uint8_t*);

// One panel for all m rows, in tiles of up to max_rows rows (tiles[r] runs r rows).
inline void run_tiles(const Tile* tiles, int64_t max_rows, const Activations& a, int64_t m, const uint8_t* panel,
                      int64_t nb, const float* bias, float* y, int64_t n, const uint8_t* end) {
  for (int64_t r0 = 0; r0 < m; r0 += max_rows)
    tiles[m - r0 < max_rows ? m - r0 : max_rows](a, r0, panel, nb, bias, y, n, end);
}

// A tile: R rows x one panel of 16 outputs over all of k. Per GGUF block: each output's 32 products as an exact
// integer sum (8 steps of 4 k: the row's 4 activation bytes broadcast, each output's 4 weight bytes in its int32
// lane), then acc = fma(float(sum), d_w * d_x, acc) and, for Q4_1, acc = fma(m_w, d_x * sum(q_x), acc). Every (row,
// output) runs that sequence over the blocks in order whatever the tile or instruction set, so a row's result is the
// same in a 1-row decode step, a 16-row verification and on either path.
namespace avx2 {
// maddubs multiplies u8 by s8 into saturating int16 pairs: Q4_1's nibbles (<= 15 x 127 x 2) never saturate; Q8_0's
// signs move onto the activations (|w| x sign(w) x <= 128 x 127 x 2 fits).
template <int Format>
inline __m256i pairs(__m256i w, __m256i x) {
  if (Format == kQ8_0) return _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  return _mm256_maddubs_epi16(w, x);
}

// int16 pairs -> += their int32 lane sums.
inline __m256i widen_add(__m256i acc, __m256i pairs16) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs16, _mm256_set1_epi16(1)));
}

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

template <int Format, int R>
void tile(const Activations& a, int64_t r0, const uint8_t* panel, int64_t nb, const float* bias, float* y,
          int64_t ldy, const uint8_t* end) {
  constexpr int64_t bytes = Format == kQ4_1 ? kQ4_1Packed : kQ8_0Packed;
  constexpr int H = 2;  // both halves of the panel in one pass: each activation broadcast serves 16 outputs
  const int64_t k = nb * kBlock;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[R][H];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    for (int hh = 0; hh < H; ++hh) acc[r][hh] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = panel + b * bytes;
    if (r0 == 0) prefetch_ahead<_MM_HINT_T0>(blk, bytes, end);
    __m256i sum[R][H];
    if (Format == kQ4_1) {
      // The block's 8 steps add their int16 pairs in int16 (an int16 lane then holds 16 products, |sum| <= 16 x 15
      // x 127 = 30480: no overflow) and widen once.
      __m256i pairs16[R][H];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        for (int hh = 0; hh < H; ++hh) pairs16[r][hh] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int l = 0; l < 4; ++l) {  // low nibbles: k step l, high nibbles: step l + 4
#pragma GCC unroll 2
        for (int hh = 0; hh < H; ++hh) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 + l * 64 + hh * 32));
          const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            const int8_t* x = a.q + (r0 + r) * k + b * kBlock;
            pairs16[r][hh] = _mm256_add_epi16(pairs16[r][hh],
                                              _mm256_add_epi16(pairs<Format>(lo, bcast4(x + 4 * l)),
                                                               pairs<Format>(hi, bcast4(x + 4 * l + 16))));
            // Pin the running sum: gcc otherwise re-associates the exact int16 adds into all 32 products live at
            // once and spills them to the stack.
            asm("" : "+x"(pairs16[r][hh]));
          }
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        for (int hh = 0; hh < H; ++hh) sum[r][hh] = _mm256_madd_epi16(pairs16[r][hh], _mm256_set1_epi16(1));
    } else {  // Q8_0's pairs reach 32512: each step widens on its own
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        for (int hh = 0; hh < H; ++hh) sum[r][hh] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int s = 0; s < 8; ++s) {
#pragma GCC unroll 2
        for (int hh = 0; hh < H; ++hh) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 + s * 64 + hh * 32));
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            sum[r][hh] = widen_add(sum[r][hh], pairs<Format>(v, bcast4(a.q + (r0 + r) * k + b * kBlock + 4 * s)));
            asm("" : "+x"(sum[r][hh]));  // as above: one running sum per row, not 64 live products
          }
        }
      }
    }
#pragma GCC unroll 2
    for (int hh = 0; hh < H; ++hh) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + hh * 16)));
      const __m256 mw = Format == kQ4_1
                            ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32 + hh * 16)))
                            : _mm256_setzero_ps();
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int64_t i = (r0 + r) * nb + b;
        acc[r][hh] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r][hh]), _mm256_mul_ps(d, _mm256_set1_ps(a.d[i])),
                                     acc[r][hh]);
        if (Format == kQ4_1) acc[r][hh] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.s[i]), acc[r][hh]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    for (int hh = 0; hh < H; ++hh) {
      __m256 out = acc[r][hh];
      if (bias) out = _mm256_add_ps(out, _mm256_loadu_ps(bias + hh * 8));
      _mm256_storeu_ps(y + (r0 + r) * ldy + hh * 8, out);
    }
}

// One panel for every row: tiles of up to kRows rows, the panel read from memory by the first and from L1 by the
// rest. 4 rows' int16 sums for both halves fill the registers. Tiles of 8 rows taking one half a pass
// were a little slower: passes of 8-64 rows take 0.94-0.99x their time this way (with the parallel rounding below,
// docs/notes.md: int8_tile_rows_ab.txt); 3-row tiles measured alike.
constexpr int kRows = 4;

template <int Format>
void panel_rows(const Activations& a, int64_t m, const uint8_t* panel, int64_t nb, const float* bias, float* y,
                int64_t n, const uint8_t* end) {
  static constexpr Tile tiles[kRows + 1] = {nullptr, tile<Format, 1>, tile<Format, 2>, tile<Format, 3>,
                                            tile<Format, 4>};
  run_tiles(tiles, kRows, a, m, panel, nb, bias, y, n, end);
}

const PanelRows kPanelRows[2] = {panel_rows<kQ4_1>, panel_rows<kQ8_0>};
}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512vnni")
namespace vnni {
// The same sequence per (row, output) as avx2::tile, a whole panel (16 int32 lanes) per zmm register: half the
// instructions. u8 x s8 -> += int32 in one dpbusd; Q8_0's signed weights become u8 by + 128 (an xor), and the block
// sum takes 128 * sum(q_x) back off - the same integers as maddubs.
template <int Format, int R>
void tile(const Activations& a, int64_t r0, const uint8_t* panel, int64_t nb, const float* bias, float* y,
          int64_t ldy, const uint8_t* end) {
  constexpr int64_t bytes = Format == kQ4_1 ? kQ4_1Packed : kQ8_0Packed;
  const int64_t k = nb * kBlock;
  __m512 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = panel + b * bytes;
    if (r0 == 0) prefetch_ahead<_MM_HINT_T1>(blk, bytes, end);
    __m512i sum[R], sum2[R];  // two chains per row (the dot's latency), added exactly at the end
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) sum[r] = sum2[r] = _mm512_setzero_si512();
    if (Format == kQ4_1) {
#pragma GCC unroll 4
      for (int l = 0; l < 4; ++l) {  // low nibbles: k step l, high nibbles: step l + 4
        const __m512i v = _mm512_loadu_si512(blk + 64 + l * 64);
        const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int8_t* x = a.q + (r0 + r) * k + b * kBlock;
          int32_t x_lo, x_hi;
          std::memcpy(&x_lo, x + 4 * l, 4);
          std::memcpy(&x_hi, x + 4 * l + 16, 4);
          sum[r] = _mm512_dpbusd_epi32(sum[r], lo, _mm512_set1_epi32(x_lo));
          sum2[r] = _mm512_dpbusd_epi32(sum2[r], hi, _mm512_set1_epi32(x_hi));
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) sum[r] = _mm512_add_epi32(sum[r], sum2[r]);
    } else {
#pragma GCC unroll 8
      for (int s = 0; s < 8; ++s) {
        const __m512i v = _mm512_xor_si512(_mm512_loadu_si512(blk + 32 + s * 64), flip);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t x4;
          std::memcpy(&x4, a.q + (r0 + r) * k + b * kBlock + 4 * s, 4);
          sum[r] = _mm512_dpbusd_epi32(sum[r], v, _mm512_set1_epi32(x4));
        }
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
    const __m512 mw = Format == kQ4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)))
                                      : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int64_t i = (r0 + r) * nb + b;
      __m512i s = sum[r];
      if (Format == kQ8_0) s = _mm512_sub_epi32(s, _mm512_set1_epi32(128 * a.qsum[i]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(a.d[i])), acc[r]);
      if (Format == kQ4_1) acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.s[i]), acc[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m512 out = bias ? _mm512_add_ps(acc[r], _mm512_loadu_ps(bias)) : acc[r];
    _mm512_storeu_ps(y + (r0 + r) * ldy, out);
  }
}

// One panel for every row: tiles of up to kRows rows (32 zmm registers: 8 rows' sums and accumulators).
constexpr int kRows = 8;

template <int Format>
void panel_rows(const Activations& a, int64_t m, const uint8_t* panel, int64_t nb, const float* bias, float* y,
                int64_t n, const uint8_t* end) {
  static constexpr Tile tiles[kRows + 1] = {nullptr, tile<Format, 1>, tile<Format, 2>, tile<Format, 3>, tile<Format, 4>,
                                            tile<Format, 5>, tile<Format, 6>, tile<Format, 7>, tile<Format, 8>};
  run_tiles(tiles, kRows, a, m, panel, nb, bias, y, n, end);
}

const PanelRows kPanelRows[2] = {panel_rows<kQ4_1>, panel_rows<kQ8_0>};
}  // namespace vnni
#pragma GCC pop_options

bool cpu_has_vnni() {
  static const bool yes = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512bw");
  return yes;
}

// The integer dot's instruction sets, in order: each one's results are the bits of the one before.
enum Isa { kAvx2 = 0, kVnni = 1, kAmx = 2 };
int isa_limit = kAmx;  // tests lower it to run a lesser path on a CPU that has a better one

int best_isa() {
  const int here = cpu_has_vnni() ? (amx::available() ? kAmx : kVnni) : kAvx2;
  return here < isa_limit ? here : isa_limit;
}

// From this many rows on, AMX runs a Q8_0 pass (where the CPU has it); fewer go to AVX512-VNNI, as Q4_1 always does
// (int8_amx.cpp says why). The LM head: 0.87x the VNNI pass's time at 8 rows, 0.62-0.87x at 12-128
// (docs/notes.md: int8_amx.txt).
constexpr int64_t kAmxMinRows = 8;

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

inline int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// One block of 32 floats -> 32 int8 (round half to even: the default MXCSR mode of cvtps) and its scalars.
inline void quantize_block(const float* v, int8_t* q, float& d, float& s, int32_t& qsum) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 x[4];
  for (int i = 0; i < 4; ++i) x[i] = _mm256_loadu_ps(v + 8 * i);
  const float amax = hmax(_mm256_max_ps(_mm256_max_ps(_mm256_and_ps(x[0], abs_mask), _mm256_and_ps(x[1], abs_mask)),
                                        _mm256_max_ps(_mm256_and_ps(x[2], abs_mask), _mm256_and_ps(x[3], abs_mask))));
  d = amax / 127.f;
  const __m256 inv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
  __m256i i32[4];
  for (int i = 0; i < 4; ++i) i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(x[i], inv));
  qsum = hsum(_mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3])));
  s = d * static_cast<float>(qsum);
  // packs interleave the 128-bit lanes; the permute puts the 32 bytes back in k order.
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// Per-thread scratch for the rounded activations (a layer step calls this ~120 times: no allocation each time).
struct Scratch {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> qsum;
};

// The scratch sized for m rows of k, as the kernel's activations (filled by quantize_blocks).
Activations reserve(int64_t m, int64_t k, Scratch& buf) {
  const int64_t nb = k / kBlock;
  if (static_cast<int64_t>(buf.q.size()) < (m + kPadRows) * k) buf.q.resize((m + kPadRows) * k);
  if (static_cast<int64_t>(buf.d.size()) < m * nb) buf.d.resize(m * nb), buf.s.resize(m * nb), buf.qsum.resize(m * nb);
  return {buf.q.data(), buf.d.data(), buf.s.data(), buf.qsum.data()};
}

// Blocks [i0, i1) of x (m x k, in blocks of 32 along each row) into a.
inline void quantize_blocks(const float* x, const Activations& a, int64_t i0, int64_t i1) {
  int8_t* q = const_cast<int8_t*>(a.q);
  float *d = const_cast<float*>(a.d), *s = const_cast<float*>(a.s);
  int32_t* qsum = const_cast<int32_t*>(a.qsum);
  for (int64_t i = i0; i < i1; ++i) quantize_block(x + i * kBlock, q + i * kBlock, d[i], s[i], qsum[i]);
}

}  // namespace

extern "C" {

// The best instruction set the integer dot runs on here: 0 AVX2, 1 AVX512-VNNI, 2 AMX (passes of several rows; one row
// runs VNNI); for the record - the results are the same.
int adaflash_int8_isa() { return best_isa(); }

// Runs no better path than `isa` (to test that every path gives the same bits); 2 restores the default.
void adaflash_int8_limit_isa(int isa) { isa_limit = isa; }

// Bytes of one packed (panel, block), or 0 for a format without this kernel.
int64_t adaflash_int8_block_bytes(int format) {
  if (adaflash::kquant::handles(format)) return adaflash::kquant::block_bytes(format);
  return format == kQ4_1 ? kQ4_1Packed : format == kQ8_0 ? kQ8_0Packed : 0;
}

// src: GGUF blocks of n rows, [n][k / 32][block] -> packed [n / 16][k / 32][packed block]. n % 16 == k % 32 == 0.
void adaflash_pack_int8(const uint8_t* src, int64_t n, int64_t k, int format, uint8_t* packed, int threads) {
  const int64_t nb = k / kBlock, src_bytes = format == kQ4_1 ? kQ4_1Src : kQ8_0Src;
  const int64_t bytes = adaflash_int8_block_bytes(format);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t p = 0; p < n / kPanel; ++p) {
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* out = packed + (p * nb + b) * bytes;
      std::memset(out, 0, bytes);
      for (int j = 0; j < kPanel; ++j) {
        const uint8_t* blk = src + ((p * kPanel + j) * nb + b) * src_bytes;
        const int h = j / 8, lane = j % 8;
        std::memcpy(out + 2 * j, blk, 2);  // d
        if (format == kQ4_1) {
          std::memcpy(out + 32 + 2 * j, blk + 2, 2);  // m
          for (int kk = 0; kk < kBlock; ++kk) {  // GGUF: byte i holds element i (low nibble) and i + 16 (high)
            const uint8_t q = kk < 16 ? blk[4 + kk] & 0x0F : blk[4 + kk - 16] >> 4;
            const int l = (kk % 16) / 4, t = kk % 4;
            out[64 + l * 64 + h * 32 + lane * 4 + t] |= kk < 16 ? q : static_cast<uint8_t>(q << 4);
          }
        } else {
          for (int kk = 0; kk < kBlock; ++kk) out[32 + (kk / 4) * 64 + h * 32 + lane * 4 + kk % 4] = blk[2 + kk];
        }
      }
    }
  }
}

// Rows per chunk of a long input (128 x k int8 activations stay in L2; 64-512 measured alike on a 3650-row prefill).
constexpr int64_t kRowChunk = 128;
// From this many blocks of activations on, the threads round them in parallel (one decode row's 18-48 blocks take
// ~0.5 us alone; a 16-row verification's ~300-800 blocks ~10 us, a serial part of every call).
constexpr int64_t kParallelQuantizeBlocks = 128;

// x [m, k] fp32 row-major, packed from adaflash_pack_int8, y [m, n], bias [n] or null.
void adaflash_int8_linear(const float* x, int64_t m, int64_t k, const uint8_t* packed, int format, int64_t n,
                          const float* bias, float* y, int threads) {
  if (m < 1) return;
  static thread_local Scratch scratch;
  const Activations a = reserve(m, k, scratch);
  const int64_t nb = k / kBlock, stride = nb * adaflash_int8_block_bytes(format), panels = n / kPanel;
  const bool parallel_quantize = threads > 1 && m * nb >= kParallelQuantizeBlocks;
  if (!parallel_quantize) quantize_blocks(x, a, 0, m * nb);
  // One panel per task: tiles of several panels (more independent chains) measured slower at every row count here
  // (AMD EPYC, 2 threads: a whole decode step's linears 4.0 ms with one, 4.8 with four at one row).
  const int isa = best_isa();
  const bool use_amx = isa == kAmx && format == kQ8_0 && m >= kAmxMinRows;
  // kquant.cpp's formats run their AVX2 path on every CPU (the same integers as a VNNI path would give).
  const PanelRows rows = adaflash::kquant::handles(format) ? adaflash::kquant::panel_rows(format)
                         : use_amx                         ? amx::kQ8_0Rows
                         : (isa == kAvx2 ? avx2::kPanelRows : vnni::kPanelRows)[format == kQ4_1 ? 0 : 1];
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), T = omp_get_num_threads();
    if (parallel_quantize) {  // the same blocks, each rounded by one thread, then every thread reads all of them
      quantize_blocks(x, a, m * nb * t / T, m * nb * (t + 1) / T);
#pragma omp barrier
    }
    if (use_amx) amx::begin();
    // Contiguous shares, as schedule(static) gives, computed here so each thread knows where its own ends.
    const int64_t p0 = panels * t / T, p1 = panels * (t + 1) / T;
    // A prefill's thousands of rows go in chunks whose int8 activations stay in L2 while the thread's panels pass
    // over them: one pass of all rows per panel streamed the whole activation matrix from L3 once per panel (a
    // 3650-row prefill ran its linears at ~80% of the 64-row speed). A row's arithmetic does not depend on its chunk.
    for (int64_t r0 = 0; r0 < m; r0 += kRowChunk) {
      const int64_t rows_here = m - r0 < kRowChunk ? m - r0 : kRowChunk;
      const Activations chunk = {a.q + r0 * k, a.d + r0 * nb, a.s + r0 * nb, a.qsum + r0 * nb};
      for (int64_t p = p0; p < p1; ++p)
        rows(chunk, rows_here, packed + p * stride, nb, bias ? bias + p * kPanel : nullptr, y + r0 * n + p * kPanel, n,
             packed + p1 * stride);
    }
    if (use_amx) amx::end();
  }
}

}  // extern "C"
