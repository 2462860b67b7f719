// The 5- and 6-bit and super-block formats of a GGUF (Q5_0, Q4_K, Q5_K, Q6_K) for both quantized kernels: the int8
// one (`--dtype int8`, int8_linear.cpp drives it) and the fp32 one (packed_linear.cpp's chunked path dequantizes
// through here). Why one layout for both: these formats carry most real GGUF files (a Q4_K_M file is Q4_K + Q6_K,
// with Q5_0 / Q8_0 where a row is not a multiple of 256), and the int8 kernel is the one that runs them at speed.
//
// Every weight is w = S * q + M with q a small unsigned integer and S, M per 32 k (16 for Q6_K) and output:
//   Q5_0: S = d, M = -16 d.   Q4_K / Q5_K: S = d * sc, M = -(dmin * m).   Q6_K: S = d * sc, M = -32 S.
// d * sc has at most 11 + 8 significant bits, exact in fp32, so the fp32 kernel's fma(S, q, M) for the K formats
// rounds once where gguf.quants.dequantize does (S * q is exact), and S * (q - 32), d * (q - 16) for Q6_K and Q5_0
// are gguf's own products: bitwise its values.
//
// Packed per (panel of 16 outputs, block of 32 k) - the body - with the super-block formats' scales once per 256 k
// ahead of their 8 bodies (quants.py packs it, in numpy):
//   body: 256 bytes of nibbles exactly as int8_linear.cpp's Q4_1 ([l][half h][output j][t]: low nibble k = 4l + t,
//         high nibble k = 16 + 4l + t), then the high bits: 5-bit formats 64 bytes [h][j][t] (bit 2l: the low nibble's
//         value at step l, bit 2l + 1: the high nibble's), Q6_K 128 bytes [h][c][j][t] (bits 4l' + 0..1 and 4l' + 2..3:
//         the low and high nibbles' values at step l = 2c + l').
//   Q5_0 block: d[16] fp16, body                                            352 bytes (= its GGUF bytes)
//   Q4_K / Q5_K super-block: d[16], dmin[16] fp16, sc[8][16], m[8][16] u8, 8 bodies   2368 / 2880 bytes
//   Q6_K super-block: d[16] fp16, sc[16][16] int8 (per 16 k), 8 bodies                3360 bytes (= GGUF)
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "int8_linear.h"

namespace {

using namespace adaflash::int8;

enum KFormat { kQ5_0 = 4, kQ4_K = 5, kQ5_K = 6, kQ6_K = 7 };

constexpr int bits_of(int f) { return f == kQ4_K ? 4 : f == kQ6_K ? 6 : 5; }
constexpr int64_t body_bytes(int f) { return 256 + (bits_of(f) == 4 ? 0 : bits_of(f) == 5 ? 64 : 128); }
constexpr int64_t header_bytes(int f) { return f == kQ5_0 ? 32 : f == kQ6_K ? 288 : 320; }
constexpr int blocks_per_header(int f) { return f == kQ5_0 ? 1 : 8; }
constexpr int64_t group_bytes(int f) { return header_bytes(f) + blocks_per_header(f) * body_bytes(f); }

// Where block b of a panel lies: its scales' header, its body, its index under that header.
struct Where {
  const uint8_t* header;
  const uint8_t* body;
  int sub;
};

template <int F>
inline Where locate(const uint8_t* panel, int64_t b) {
  const uint8_t* header = panel + (b / blocks_per_header(F)) * group_bytes(F);
  const int sub = static_cast<int>(b % blocks_per_header(F));
  return {header, header + header_bytes(F) + sub * body_bytes(F), sub};
}

inline __m256 half8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 u8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 i8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Half h's (outputs 8h..8h+7) scales of a block: S and M, or for Q6_K S of k < 16 (s0) and of k >= 16 (s1).
template <int F>
inline void scales(const Where& w, int h, __m256& s0, __m256& s1) {
  const __m256 d = half8(w.header + 16 * h);
  if (F == kQ5_0) {
    s0 = d;
    s1 = _mm256_mul_ps(d, _mm256_set1_ps(-16.f));
  } else if (F == kQ6_K) {
    s0 = _mm256_mul_ps(d, i8x8(w.header + 32 + (2 * w.sub) * 16 + 8 * h));
    s1 = _mm256_mul_ps(d, i8x8(w.header + 32 + (2 * w.sub + 1) * 16 + 8 * h));
  } else {
    const __m256 dmin = half8(w.header + 32 + 16 * h);
    s0 = _mm256_mul_ps(d, u8x8(w.header + 64 + w.sub * 16 + 8 * h));
    s1 = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin, u8x8(w.header + 192 + w.sub * 16 + 8 * h)));
  }
}

// The 32 bytes of half h at step l: lo = the values of k = 4l + t, hi = of k = 16 + 4l + t (byte j * 4 + t: output
// 8h + j), unsigned 0..2^bits - 1.
template <int F>
inline void values(const uint8_t* body, int h, int l, __m256i& lo, __m256i& hi) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(body + l * 64 + h * 32));
  lo = _mm256_and_si256(v, low4);
  hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
  if (bits_of(F) == 5) {
    const __m256i p = _mm256_srli_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(body + 256 + h * 32)), 2 * l);
    // masked to one bit a byte before the 16-bit shift: nothing crosses into the next byte
    lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(p, _mm256_set1_epi8(0x01)), 4));
    hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(p, _mm256_set1_epi8(0x02)), 3));
  } else if (bits_of(F) == 6) {
    const __m256i p = _mm256_srli_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(body + 256 + h * 64 + (l / 2) * 32)), 4 * (l % 2));
    lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(p, _mm256_set1_epi8(0x03)), 4));
    hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(p, _mm256_set1_epi8(0x0C)), 2));
  }
}

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

inline __m256i widen(__m256i pairs16) { return _mm256_madd_epi16(pairs16, _mm256_set1_epi16(1)); }

// A tile: R rows x one panel over all of k. Up to 2 rows take both halves of the panel (16 outputs) in one pass over
// the blocks; more rows take one half a pass (8 outputs), so R accumulators and R running sums stay in registers, and
// the second pass reads the panel from L1 / L2 (5-11% faster at 8-16 rows for Q4_K and Q5_0 than both halves at once,
// in one process on a 2-core EPYC; one row's pass is bound by the weight stream, which two passes would idle).
// Per block and output the integer sums are exact: unsigned formats sum q * x (maddubs: u8 x s8 pairs, <= 2 x 31 x 127
// for 5 bits, added in int16 over two steps and then widened; 4 bits over the whole block), Q6_K sums (q - 32) * x per
// 16 k (signs moved onto x as int8_linear.cpp's Q8_0; 4 steps of pairs <= 2 x 32 x 127 fit int16). Then
// acc = fma(sum, S d_x, acc) and acc = fma(M, d_x sum(x), acc), or Q6_K's two sums each with its S. The same sequence
// per (row, output) at every tile size: a row's result never depends on m.
template <int F, int R>
void tile(const Activations& a, int64_t r0, const uint8_t* panel, int64_t nb, const float* bias, float* y, int64_t ldy,
          const uint8_t* end) {
  constexpr int H = R <= 2 || F == kQ6_K ? 2 : 1;  // halves a pass (Q6_K: 7-12% slower in two passes at 4-16 rows)
  const int64_t k = nb * kBlock;
  for (int h0 = 0; h0 < 2; h0 += H) {
    __m256 acc[R][H];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      for (int hh = 0; hh < H; ++hh) acc[r][hh] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const Where w = locate<F>(panel, b);
      if (r0 == 0 && h0 == 0) {
        const uint8_t* from = w.sub == 0 ? w.header : w.body;
        prefetch_ahead<_MM_HINT_T0>(from, w.body + body_bytes(F) - from, end);
      }
#pragma GCC unroll 2
      for (int hh = 0; hh < H; ++hh) {
        const int h = h0 + hh;
        __m256i sum0[R], sum1[R];  // sum1: Q6_K's second 16 k; 5 bits: the int16 pairs of two steps
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) sum0[r] = sum1[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int l = 0; l < 4; ++l) {
          __m256i lo, hi;
          values<F>(w.body, h, l, lo, hi);
          if (F == kQ6_K) {
            lo = _mm256_sub_epi8(lo, _mm256_set1_epi8(32));
            hi = _mm256_sub_epi8(hi, _mm256_set1_epi8(32));
          }
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            const int8_t* x = a.q + (r0 + r) * k + b * kBlock;
            const __m256i xl = bcast4(x + 4 * l), xh = bcast4(x + 16 + 4 * l);
            if (F == kQ6_K) {
              sum0[r] = _mm256_add_epi16(sum0[r],
                                         _mm256_maddubs_epi16(_mm256_sign_epi8(lo, lo), _mm256_sign_epi8(xl, lo)));
              sum1[r] = _mm256_add_epi16(sum1[r],
                                         _mm256_maddubs_epi16(_mm256_sign_epi8(hi, hi), _mm256_sign_epi8(xh, hi)));
              asm("" : "+x"(sum0[r]), "+x"(sum1[r]));  // one running sum per row (int8_linear.cpp says why)
            } else if (bits_of(F) == 4) {
              sum0[r] = _mm256_add_epi16(sum0[r],
                                         _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh)));
              asm("" : "+x"(sum0[r]));
            } else {
              sum1[r] = _mm256_add_epi16(sum1[r],
                                         _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh)));
              if (l % 2) {
                sum0[r] = _mm256_add_epi32(sum0[r], widen(sum1[r]));
                sum1[r] = _mm256_setzero_si256();
              }
              asm("" : "+x"(sum0[r]), "+x"(sum1[r]));
            }
          }
        }
        __m256 s0, s1;
        scales<F>(w, h, s0, s1);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int64_t i = (r0 + r) * nb + b;
          const __m256 dx = _mm256_set1_ps(a.d[i]);
          if (F == kQ6_K) {
            acc[r][hh] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(widen(sum0[r])), _mm256_mul_ps(s0, dx), acc[r][hh]);
            acc[r][hh] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(widen(sum1[r])), _mm256_mul_ps(s1, dx), acc[r][hh]);
          } else {
            const __m256i s = bits_of(F) == 4 ? widen(sum0[r]) : sum0[r];
            acc[r][hh] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(s0, dx), acc[r][hh]);
            acc[r][hh] = _mm256_fmadd_ps(s1, _mm256_set1_ps(a.s[i]), acc[r][hh]);
          }
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      for (int hh = 0; hh < H; ++hh) {
        const int h = h0 + hh;
        const __m256 out = bias ? _mm256_add_ps(acc[r][hh], _mm256_loadu_ps(bias + h * 8)) : acc[r][hh];
        _mm256_storeu_ps(y + (r0 + r) * ldy + h * 8, out);
      }
  }
}

constexpr int kRows = 4;

template <int F>
void panel_rows(const Activations& a, int64_t m, const uint8_t* panel, int64_t nb, const float* bias, float* y,
                int64_t n, const uint8_t* end) {
  static constexpr void (*tiles[kRows + 1])(const Activations&, int64_t, const uint8_t*, int64_t, const float*, float*,
                                            int64_t, const uint8_t*) = {nullptr, tile<F, 1>, tile<F, 2>, tile<F, 3>,
                                                                        tile<F, 4>};
  for (int64_t r0 = 0; r0 < m; r0 += kRows) tiles[m - r0 < kRows ? m - r0 : kRows](a, r0, panel, nb, bias, y, n, end);
}

// Blocks [b0, b1) of one packed panel -> fp32 [(b1 - b0) * 32][16], gguf's values (see the top).
template <int F>
void dequant(const uint8_t* panel, int64_t b0, int64_t b1, float* out) {
  for (int64_t b = b0; b < b1; ++b) {
    const Where w = locate<F>(panel, b);
    float* dst = out + (b - b0) * kBlock * kPanel;
    for (int h = 0; h < 2; ++h) {
      __m256 s0, s1;
      scales<F>(w, h, s0, s1);
      for (int l = 0; l < 4; ++l) {
        __m256i lo, hi;
        values<F>(w.body, h, l, lo, hi);
        for (int t = 0; t < 4; ++t) {
          const __m256i ql = _mm256_and_si256(_mm256_srli_epi32(lo, 8 * t), _mm256_set1_epi32(0xFF));
          const __m256i qh = _mm256_and_si256(_mm256_srli_epi32(hi, 8 * t), _mm256_set1_epi32(0xFF));
          __m256 wl, wh;
          if (F == kQ6_K || F == kQ5_0) {  // S * (q - 32), d * (q - 16): one rounding and a zero's sign, as gguf's
            const __m256i off = _mm256_set1_epi32(F == kQ6_K ? 32 : 16);
            wl = _mm256_mul_ps(s0, _mm256_cvtepi32_ps(_mm256_sub_epi32(ql, off)));
            wh = _mm256_mul_ps(F == kQ6_K ? s1 : s0, _mm256_cvtepi32_ps(_mm256_sub_epi32(qh, off)));
          } else {  // S * q exact, + M rounded once
            wl = _mm256_fmadd_ps(s0, _mm256_cvtepi32_ps(ql), s1);
            wh = _mm256_fmadd_ps(s0, _mm256_cvtepi32_ps(qh), s1);
          }
          _mm256_storeu_ps(dst + (4 * l + t) * kPanel + 8 * h, wl);
          _mm256_storeu_ps(dst + (16 + 4 * l + t) * kPanel + 8 * h, wh);
        }
      }
    }
  }
}

}  // namespace

namespace adaflash::kquant {

bool handles(int format) { return format >= kQ5_0 && format <= kQ6_K; }

// Bytes of one packed (panel, block of 32), on average over a super-block (8 blocks share its scales).
int64_t block_bytes(int format) {
  switch (format) {
    case kQ5_0: return group_bytes(kQ5_0);
    case kQ4_K: return group_bytes(kQ4_K) / 8;
    case kQ5_K: return group_bytes(kQ5_K) / 8;
    case kQ6_K: return group_bytes(kQ6_K) / 8;
  }
  return 0;
}

PanelRows panel_rows(int format) {
  switch (format) {
    case kQ5_0: return ::panel_rows<kQ5_0>;
    case kQ4_K: return ::panel_rows<kQ4_K>;
    case kQ5_K: return ::panel_rows<kQ5_K>;
    case kQ6_K: return ::panel_rows<kQ6_K>;
  }
  return nullptr;
}

void dequant(int format, const uint8_t* panel, int64_t b0, int64_t b1, float* out) {
  switch (format) {
    case kQ5_0: return ::dequant<kQ5_0>(panel, b0, b1, out);
    case kQ4_K: return ::dequant<kQ4_K>(panel, b0, b1, out);
    case kQ5_K: return ::dequant<kQ5_K>(panel, b0, b1, out);
    case kQ6_K: return ::dequant<kQ6_K>(panel, b0, b1, out);
  }
}

}  // namespace adaflash::kquant
