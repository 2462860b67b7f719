// packed_linear.cpp's kernels with a panel's 16 outputs in one 16-lane vector, where the CPU has AVX-512: the few-rows
// path (1-4 rows: a decode step, a short verification), the blocked micro-kernel (5+ rows) and the dequantisation
// into its k-chunk. Each output keeps its one FMA chain over k and each weight its dequantisation (the same
// instructions per lane), so every output is bitwise the 8-lane path's (tested), from about half the instructions.
// A separate file under its own target: templates shared with the 8-lane code would compile that code for AVX-512
// too, and it must run on AVX2-only CPUs. Measured on an AMX Xeon: the fp32 target's forwards of 1-2 tokens
// 0.92-1.00x the time, 4-8 tokens 0.82-0.90x, 16 tokens 0.90-0.94x (docs/notes.md: fp32_lanes_ab.txt).
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "packed_linear.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw")

namespace adaflash::packed::avx512 {
namespace {

// packed_linear.cpp's few_rows, one vector per (row, panel).
template <int MR, int NP, class Src>
inline void few_rows(const float* x, int64_t ldx, int64_t k, int64_t block, float* y, int64_t ldy, const float* bias,
                     const Src& src) {
  __m512 acc[MR][NP];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < k; k0 += block) {
    const auto weights = src.block(k0 / block);
    for (int64_t j = 0; j < block; ++j) {
      __m512 a[MR];
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) a[r] = _mm512_set1_ps(x[r * ldx + k0 + j]);
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) {
        const __m512 w = weights.load(p, j);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) acc[r][p] = _mm512_fmadd_ps(a[r], w, acc[r][p]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      float* out = y + r * ldy + p * kPanel;
      _mm512_storeu_ps(out, bias ? _mm512_add_ps(acc[r][p], _mm512_loadu_ps(bias + p * kPanel)) : acc[r][p]);
    }
}

struct Fp32Block {
  const float* w;
  int64_t stride;  // floats between panels
  inline __m512 load(int p, int64_t j) const { return _mm512_loadu_ps(w + p * stride + j * kPanel); }
};

struct Fp32Source {
  const float* w;
  int64_t stride;
  Fp32Block block(int64_t) const { return {w, stride}; }
};

inline __m512 half16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <int Format, int NP>
struct QuantBlock {
  const uint8_t* blk[NP];
  __m512 d[NP], m[NP];
  inline __m512 load(int p, int64_t j) const {
    if (Format == kBF16) {
      const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk[p] + j * 32)));
      return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
    }
    if (Format == kQ4_1) {
      // Byte i holds output i's nibble low and output i + 8's high: the 8 bytes twice, widened to 16 lanes, lanes 8-15
      // shifted by 4, masked - three instructions where unpacking to bytes first took five. d * q is exact in fp32 (11
      // and 4 significant bits), so one FMA rounds d * q + m as the product-then-sum of gguf's dequantisation does.
      int64_t bytes;
      std::memcpy(&bytes, blk[p] + 64 + j * 8, 8);
      const __m512i both = _mm512_cvtepu8_epi32(_mm_set1_epi64x(bytes));
      const __m512i high_by_4 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4);
      const __m512i quants = _mm512_and_si512(_mm512_srlv_epi32(both, high_by_4), _mm512_set1_epi32(0x0F));
      return _mm512_fmadd_ps(d[p], _mm512_cvtepi32_ps(quants), m[p]);
    }
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk[p] + 32 + j * 16));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d[p]);
  }
};

template <int Format, int NP>
struct QuantSource {
  const uint8_t* base;
  int64_t stride;  // bytes between panels
  QuantBlock<Format, NP> block(int64_t b) const {
    constexpr int64_t bytes = packed_block_bytes(Format);
    QuantBlock<Format, NP> out;
    for (int p = 0; p < NP; ++p) {
      out.blk[p] = base + p * stride + b * bytes;
      if (Format == kBF16) continue;  // no scales
      out.d[p] = half16(out.blk[p]);
      if (Format == kQ4_1) out.m[p] = half16(out.blk[p] + 32);
    }
    return out;
  }
};

template <int MR, int NP>
void few_fp32_rows(const float* x, int64_t k, const void* panel, int64_t stride, float* y, int64_t n,
                   const float* bias) {
  few_rows<MR, NP>(x, k, k, k, y, n, bias, Fp32Source{static_cast<const float*>(panel), stride});
}

template <int Format, int MR, int NP>
void few_quant(const float* x, int64_t k, const void* panel, int64_t stride, float* y, int64_t n, const float* bias) {
  few_rows<MR, NP>(x, k, k, kBlock, y, n, bias, QuantSource<Format, NP>{static_cast<const uint8_t*>(panel), stride});
}

// packed_linear.cpp's micro with a row's 16 outputs in one vector (one accumulator a row: up to 12 rows a block).
template <int MR>
inline void micro(const float* x, int64_t ldx, const float* panel, int64_t k0, int64_t k1, float* y, int64_t ldy,
                  const float* bias, bool first, bool last) {
  __m512 acc[MR];
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) acc[r] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + r * ldy);
  for (int64_t k = k0; k < k1; ++k) {
    const __m512 b = _mm512_loadu_ps(panel + (k - k0) * kPanel);
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), b, acc[r]);
  }
  const __m512 b = last && bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(y + r * ldy, last && bias ? _mm512_add_ps(acc[r], b) : acc[r]);
}

using Micro = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t, const float*, bool,
                       bool);
constexpr Micro kMicro[13] = {nullptr,   micro<1>, micro<2>, micro<3>,  micro<4>,  micro<5>, micro<6>,
                              micro<7>,  micro<8>, micro<9>, micro<10>, micro<11>, micro<12>};

// packed_linear.cpp's chunk_rows in blocks of up to 12 rows.
inline void blocked_rows(const float* x, int64_t m, int64_t k, const float* panel, int64_t k0, int64_t k1,
                         float* y, int64_t n, const float* bias) {
  for (int64_t r0 = 0; r0 < m; r0 += 12) {
    const int mr = static_cast<int>(m - r0 < 12 ? m - r0 : 12);
    kMicro[mr](x + r0 * k, k, panel, k0, k1, y + r0 * n, n, bias, k0 == 0, k1 == k);
  }
}

}  // namespace

bool allow = true;  // tests turn it off to compare the 8-lane path's bits on an AVX-512 CPU

bool enabled() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  return allow && has;
}

// One accumulator per (row, panel): 4-8 of them cover the FMA latency.
const int kFewPanels[kFewRows + 1] = {0, 4, 4, 2, 2};

const Few* few_fp32(bool np) {
  static constexpr Few many[] = {nullptr, few_fp32_rows<1, 4>, few_fp32_rows<2, 4>, few_fp32_rows<3, 2>,
                                 few_fp32_rows<4, 2>};
  static constexpr Few one[] = {nullptr, few_fp32_rows<1, 1>, few_fp32_rows<2, 1>, few_fp32_rows<3, 1>,
                                few_fp32_rows<4, 1>};
  return np ? many : one;
}

template <int Format>
const Few* few_quant_of(bool np) {
  static constexpr Few many[] = {nullptr, few_quant<Format, 1, 4>, few_quant<Format, 2, 4>, few_quant<Format, 3, 2>,
                                 few_quant<Format, 4, 2>};
  static constexpr Few one[] = {nullptr, few_quant<Format, 1, 1>, few_quant<Format, 2, 1>, few_quant<Format, 3, 1>,
                                few_quant<Format, 4, 1>};
  return np ? many : one;
}

const Few* few_quant(int format, bool np) {
  return format == kQ4_1   ? few_quant_of<kQ4_1>(np)
         : format == kQ8_0 ? few_quant_of<kQ8_0>(np)
                           : few_quant_of<kBF16>(np);
}

void chunk_rows(const float* x, int64_t m, int64_t k, const float* panel, int64_t k0, int64_t k1, float* y, int64_t n,
                const float* bias) {
  blocked_rows(x, m, k, panel, k0, k1, y, n, bias);
}

template <int Format>
void dequant_as(const uint8_t* panel, int64_t b0, int64_t b1, float* out) {
  for (int64_t b = b0; b < b1; ++b) {
    const QuantBlock<Format, 1> blk = QuantSource<Format, 1>{panel, 0}.block(b);
    float* dst = out + (b - b0) * kBlock * kPanel;
    for (int kk = 0; kk < kBlock; ++kk) _mm512_storeu_ps(dst + kk * kPanel, blk.load(0, kk));
  }
}

void dequant(int format, const uint8_t* panel, int64_t b0, int64_t b1, float* out) {
  (format == kQ4_1 ? dequant_as<kQ4_1> : format == kQ8_0 ? dequant_as<kQ8_0> : dequant_as<kBF16>)(panel, b0, b1, out);
}

}  // namespace adaflash::packed::avx512

extern "C" {
// allow = 0 runs the 8-lane (AVX2) paths even where AVX-512 exists (to test that both give the same bits); 1 restores
// the default.
void adaflash_linear_allow_avx512(int allow) { adaflash::packed::avx512::allow = allow != 0; }
}

#pragma GCC pop_options
