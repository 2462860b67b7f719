// y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) over fp32 weights packed once into panels of 16 outputs:
// panel p holds W[16p : 16p + 16, :] transposed, [K][16], so a k-step loads two AVX2 vectors of weights and
// broadcasts one x value per row (the outer-product micro-kernel of BLAS, up to 6 rows at a time).
//
// Why own it: stock CPU kernels make a 16-row pass cost ~2.2x a 1-row pass and stream a 1-row pass at ~60% of
// the memory bandwidth; this one streams each panel once for all rows (k-chunks stay in L1 across row blocks).
// Each output is one FMA chain over k in order, whatever the number of rows, so this kernel gives a row bitwise the
// same result in a 1-row decode step and in a 16-row verification (where the per-machine choice runs it for both).
// Where the CPU has AVX-512 a panel's 16 outputs run as one 16-lane vector (packed_linear_avx512.cpp): the same
// chains, fewer instructions.
// n must be a multiple of 16 (the Python side falls back to the stock kernel otherwise).
//
// Quantized weights (a GGUF's own Q4_1 / Q8_0 blocks here, Q5_0 and the K formats dequantized by kquant.cpp): 4-8x
// fewer bytes to stream at a decode step. A panel's k-chunk is dequantized into an L1 scratch with exactly gguf's arithmetic (d * q rounded,
// then + m rounded: one FMA, since d * q has at most 11 + 4 significant bits and is exact in fp32; Q8_0's d * q
// alone) and run through the same micro-kernel, so the output is bitwise the fp32 kernel's on the dequantized weights - the same
// target, fewer bytes.
//
// BF16 weights (a drafter checkpoint saved in bf16, run in fp32): each weight widens exactly to fp32 (a 16-bit shift),
// so the output is bitwise the fp32 kernel's on the same values, streaming half its bytes.
#include <immintrin.h>
#include <cstdint>
#include <cstring>

#include "int8_linear.h"
#include "packed_linear.h"

namespace {

using namespace adaflash::packed;

// k in [k0, k1) for MR rows of one panel (`panel` points at row k0 of the panel's [K][16]); partial sums wait in y between chunks (stored and reloaded exactly, so
// chunking does not change the FMA chain). The bias is added after the last chunk.
template <int MR>
inline void micro(const float* x, int64_t ldx, const float* panel, int64_t k0, int64_t k1, float* y, int64_t ldy,
                  const float* bias, bool first, bool last) {
  // Every loop over r is unrolled so the accumulators stay in registers (gcc keeps an array indexed by a loop
  // variable in memory, storing it on every k-step).
  __m256 acc0[MR], acc1[MR];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    acc0[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + r * ldy);
    acc1[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + r * ldy + 8);
  }
  for (int64_t k = k0; k < k1; ++k) {
    const __m256 b0 = _mm256_loadu_ps(panel + (k - k0) * kPanel);
    const __m256 b1 = _mm256_loadu_ps(panel + (k - k0) * kPanel + 8);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);
      acc0[r] = _mm256_fmadd_ps(a, b0, acc0[r]);
      acc1[r] = _mm256_fmadd_ps(a, b1, acc1[r]);
    }
  }
  const __m256 bias0 = last && bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 bias1 = last && bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_ps(y + r * ldy, last && bias ? _mm256_add_ps(acc0[r], bias0) : acc0[r]);
    _mm256_storeu_ps(y + r * ldy + 8, last && bias ? _mm256_add_ps(acc1[r], bias1) : acc1[r]);
  }
}

using Micro = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t, const float*, bool,
                       bool);
constexpr Micro kMicro[7] = {nullptr, micro<1>, micro<2>, micro<3>, micro<4>, micro<5>, micro<6>};

// Every row block of one panel over one k-chunk whose weights are `panel` ([k1 - k0][16] floats).
inline void chunk_rows(const float* x, int64_t m, int64_t k, const float* panel, int64_t k0, int64_t k1, float* y,
                       int64_t n, const float* bias) {
  // Blocks of 6 rows, but 7 or 8 left go as 4 + 3 / 4 + 4: a 1- or 2-row block has too few accumulators to hide
  // the FMA latency. (Any blocking gives each row the same FMA chain, so the outputs do not change.)
  for (int64_t r0 = 0; r0 < m;) {
    const int64_t left = m - r0;
    const int mr = static_cast<int>(left == 7 || left == 8 ? 4 : left < 6 ? left : 6);
    kMicro[mr](x + r0 * k, k, panel, k0, k1, y + r0 * n, n, bias, k0 == 0, k1 == k);
    r0 += mr;
  }
}

// GGUF source blocks (32 consecutive k of one output row): Q4_1 d fp16, m fp16, 16 bytes (byte i: element i low
// nibble, element i + 16 high nibble); Q8_0 d fp16, 32 int8; BF16 32 bf16 (the row's k in order). Packed as
// packed_linear.h says.
constexpr int64_t kQ4_1Src = 20, kQ8_0Src = 34, kBF16Src = 64;

constexpr int64_t source_block_bytes(int format) {
  return format == kQ4_1 ? kQ4_1Src : format == kQ8_0 ? kQ8_0Src : kBF16Src;
}

// 8 bf16 -> 8 fp32, exactly (the bf16 bits are the fp32's high half).
inline __m256 bf16x8(const uint8_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

inline __m256 half8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// Blocks [b0, b1) of one packed panel -> fp32 [(b1 - b0) * 32][16].
void dequant(int format, const uint8_t* panel, int64_t b0, int64_t b1, float* out) {
  const int64_t bytes = packed_block_bytes(format);
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* blk = panel + b * bytes;
    float* dst = out + (b - b0) * kBlock * kPanel;
    if (format == kBF16) {
      for (int kk = 0; kk < kBlock; ++kk) {
        _mm256_storeu_ps(dst + kk * kPanel, bf16x8(blk + kk * 32));
        _mm256_storeu_ps(dst + kk * kPanel + 8, bf16x8(blk + kk * 32 + 16));
      }
      continue;
    }
    const __m256 d0 = half8(blk), d1 = half8(blk + 16);
    if (format == kQ4_1) {
      const __m256 m0 = half8(blk + 32), m1 = half8(blk + 48);
      const __m256i low4 = _mm256_set1_epi32(0x0F);
      for (int kk = 0; kk < kBlock; ++kk) {
        const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 64 + kk * 8)));
        const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(q, low4));
        const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4));
        _mm256_storeu_ps(dst + kk * kPanel, _mm256_fmadd_ps(d0, lo, m0));
        _mm256_storeu_ps(dst + kk * kPanel + 8, _mm256_fmadd_ps(d1, hi, m1));
      }
    } else {
      for (int kk = 0; kk < kBlock; ++kk) {
        const uint8_t* q = blk + 32 + kk * 16;
        const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
        const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8))));
        _mm256_storeu_ps(dst + kk * kPanel, _mm256_mul_ps(lo, d0));
        _mm256_storeu_ps(dst + kk * kPanel + 8, _mm256_mul_ps(hi, d1));
      }
    }
  }
}


// A few rows (a batch-1 decode step, a short verification) against NP panels at once, over all of k. One panel and
// one row give 2 FMA chains, which the FMA latency throttles; MR rows x NP panels give 2 * MR * NP independent chains.
// Each chain is still the in-order sum over k that the blocked path computes (the bias added last), so the outputs
// are bitwise the same. `src.block(b)` gives the weights of k in [b * block, (b + 1) * block) (block divides k):
// its load(p, j, w0, w1) yields panel p's 16 weights at the block's j-th k.
template <int MR, int NP, class Src>
inline void few_rows(const float* x, int64_t ldx, int64_t k, int64_t block, float* y, int64_t ldy, const float* bias,
                     const Src& src) {
  __m256 acc[MR][NP][2];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) acc[r][p][0] = acc[r][p][1] = _mm256_setzero_ps();
  for (int64_t k0 = 0; k0 < k; k0 += block) {
    const auto weights = src.block(k0 / block);
    for (int64_t j = 0; j < block; ++j) {
      __m256 a[MR];
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) a[r] = _mm256_broadcast_ss(x + r * ldx + k0 + j);
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) {
        __m256 w0, w1;
        weights.load(p, j, w0, w1);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          acc[r][p][0] = _mm256_fmadd_ps(a[r], w0, acc[r][p][0]);
          acc[r][p][1] = _mm256_fmadd_ps(a[r], w1, acc[r][p][1]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      float* out = y + r * ldy + p * kPanel;
      _mm256_storeu_ps(out, bias ? _mm256_add_ps(acc[r][p][0], _mm256_loadu_ps(bias + p * kPanel)) : acc[r][p][0]);
      _mm256_storeu_ps(out + 8, bias ? _mm256_add_ps(acc[r][p][1], _mm256_loadu_ps(bias + p * kPanel + 8)) : acc[r][p][1]);
    }
}

struct Fp32Block {
  const float* w;
  int64_t stride;  // floats between panels
  inline void load(int p, int64_t j, __m256& w0, __m256& w1) const {
    w0 = _mm256_loadu_ps(w + p * stride + j * kPanel);
    w1 = _mm256_loadu_ps(w + p * stride + j * kPanel + 8);
  }
};

struct Fp32Source {
  const float* w;
  int64_t stride;
  Fp32Block block(int64_t) const { return {w, stride}; }  // one block: all of k
};

// One GGUF block of NP panels: the scales converted once, the quants dequantized in registers with dequant()'s
// arithmetic (d * q + m in one FMA: the product is exact, so this is gguf's rounded product, then rounded sum).
template <int Format, int NP>
struct QuantBlock {
  const uint8_t* blk[NP];
  __m256 d[NP][2], m[NP][2];
  inline void load(int p, int64_t j, __m256& w0, __m256& w1) const {
    if (Format == kBF16) {
      w0 = bf16x8(blk[p] + j * 32);
      w1 = bf16x8(blk[p] + j * 32 + 16);
    } else if (Format == kQ4_1) {
      const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk[p] + 64 + j * 8)));
      w0 = _mm256_fmadd_ps(d[p][0], _mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(0x0F))), m[p][0]);
      w1 = _mm256_fmadd_ps(d[p][1], _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), m[p][1]);
    } else {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk[p] + 32 + j * 16));
      w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d[p][0]);
      w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))), d[p][1]);
    }
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
      out.d[p][0] = half8(out.blk[p]), out.d[p][1] = half8(out.blk[p] + 16);
      if (Format == kQ4_1) out.m[p][0] = half8(out.blk[p] + 32), out.m[p][1] = half8(out.blk[p] + 48);
    }
    return out;
  }
};

template <int MR, int NP>
void few_fp32(const float* x, int64_t k, const void* panel, int64_t stride, float* y, int64_t n, const float* bias) {
  few_rows<MR, NP>(x, k, k, k, y, n, bias, Fp32Source{static_cast<const float*>(panel), stride});
}

template <int Format, int MR, int NP>
void few_quant(const float* x, int64_t k, const void* panel, int64_t stride, float* y, int64_t n, const float* bias) {
  few_rows<MR, NP>(x, k, k, kBlock, y, n, bias, QuantSource<Format, NP>{static_cast<const uint8_t*>(panel), stride});
}

constexpr int kFewPanels[kFewRows + 1] = {0, 2, 2, 1, 1};  // NP per row count: 8 accumulators or fewer

// Columns of `few` per row count m in 1..kFewRows; panels [p, p + NP) per call (NP = panels[m]), the remainder one
// panel at a time.
void run_few(const Few* few_np, const Few* few_1, const int* panels_per_call, int m, const float* x, int64_t k,
             const void* packed, int64_t panel_bytes, int64_t stride, int64_t n, const float* bias, float* y,
             int threads) {
  const int np = panels_per_call[m];
  const int64_t panels = n / kPanel, groups = (panels + np - 1) / np;
  const char* base = static_cast<const char*>(packed);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t p = g * np; p < (g + 1) * np && p < panels;) {
      const bool whole = p + np <= panels && p == g * np;
      (whole ? few_np : few_1)[m](x, k, base + p * panel_bytes, stride, y + p * kPanel, n, bias ? bias + p * kPanel : nullptr);
      p += whole ? np : 1;
    }
  }
}


}  // namespace

extern "C" {

// w: [n, k] row-major -> packed: [n / 16][k][16].
// threads: torch's count, passed in because an OpenMP region takes the calling thread's count, which is torch's only
// on threads where torch itself has run a parallel region.
void adaflash_pack(const float* w, int64_t n, int64_t k, float* packed, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t p = 0; p < n / kPanel; ++p) {
    float* dst = packed + p * k * kPanel;
    for (int64_t kk = 0; kk < k; ++kk) {
      for (int j = 0; j < kPanel; ++j) dst[kk * kPanel + j] = w[(p * kPanel + j) * k + kk];
    }
  }
}

// x: [m, k] row-major, y: [m, n] row-major, bias: [n] or null.
void adaflash_packed_linear(const float* x, int64_t m, int64_t k, const float* packed, int64_t n, const float* bias,
                            float* y, int threads) {
  if (m < 1) return;
  if (m <= kFewRows) {
    static constexpr Few np[] = {nullptr, few_fp32<1, 2>, few_fp32<2, 2>, few_fp32<3, 1>, few_fp32<4, 1>};
    static constexpr Few one[] = {nullptr, few_fp32<1, 1>, few_fp32<2, 1>, few_fp32<3, 1>, few_fp32<4, 1>};
    const bool wide = avx512::enabled();
    run_few(wide ? avx512::few_fp32(true) : np, wide ? avx512::few_fp32(false) : one,
            wide ? avx512::kFewPanels : kFewPanels, static_cast<int>(m), x, k, packed, k * kPanel * 4, k * kPanel, n,
            bias, y, threads);
    return;
  }
  const bool wide = avx512::enabled();
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t p = 0; p < n / kPanel; ++p) {
    const float* panel = packed + p * k * kPanel;
    const float* b = bias ? bias + p * kPanel : nullptr;
    for (int64_t k0 = 0; k0 < k; k0 += kChunk) {
      const int64_t k1 = k0 + kChunk < k ? k0 + kChunk : k;
      (wide ? avx512::chunk_rows : chunk_rows)(x, m, k, panel + k0 * kPanel, k0, k1, y + p * kPanel, n, b);
    }
  }
}

// src: GGUF blocks of n rows, [n][k / 32][block] -> packed: [n / 16][k / 32][packed block]. k % 32 == 0.
void adaflash_pack_quantized(const uint8_t* src, int64_t n, int64_t k, int format, uint8_t* packed, int threads) {
  const int64_t nb = k / kBlock, src_bytes = source_block_bytes(format), bytes = packed_block_bytes(format);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t p = 0; p < n / kPanel; ++p) {
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* out = packed + (p * nb + b) * bytes;
      std::memset(out, 0, bytes);
      for (int j = 0; j < kPanel; ++j) {
        const uint8_t* blk = src + ((p * kPanel + j) * nb + b) * src_bytes;
        if (format == kBF16) {
          for (int kk = 0; kk < kBlock; ++kk) std::memcpy(out + kk * 32 + 2 * j, blk + 2 * kk, 2);
          continue;
        }
        std::memcpy(out + 2 * j, blk, 2);  // d
        if (format == kQ4_1) {
          std::memcpy(out + 32 + 2 * j, blk + 2, 2);  // m
          for (int kk = 0; kk < kBlock; ++kk) {
            const uint8_t q = kk < 16 ? blk[4 + kk] & 0x0F : blk[4 + kk - 16] >> 4;
            out[64 + kk * 8 + j % 8] |= j < 8 ? q : static_cast<uint8_t>(q << 4);
          }
        } else {
          for (int kk = 0; kk < kBlock; ++kk) out[32 + kk * 16 + j] = blk[2 + kk];
        }
      }
    }
  }
}

// As adaflash_packed_linear, over packed quantized blocks.
void adaflash_quantized_linear(const float* x, int64_t m, int64_t k, const uint8_t* packed, int format, int64_t n,
                               const float* bias, float* y, int threads) {
  if (m < 1) return;
  // kquant.cpp's formats (Q5_0, Q4_K, Q5_K, Q6_K): its layout, dequantized by it into the chunked path at every row
  // count (they run at speed on the int8 kernel; this one keeps the fp32 target's exact values).
  const bool kquant = adaflash::kquant::handles(format);
  const int64_t nb = k / kBlock, bytes = kquant ? adaflash::kquant::block_bytes(format) : packed_block_bytes(format);
  if (m <= kFewRows && !kquant) {
    static constexpr Few q4_np[] = {nullptr, few_quant<kQ4_1, 1, 2>, few_quant<kQ4_1, 2, 2>, few_quant<kQ4_1, 3, 1>,
                                    few_quant<kQ4_1, 4, 1>};
    static constexpr Few q4_one[] = {nullptr, few_quant<kQ4_1, 1, 1>, few_quant<kQ4_1, 2, 1>, few_quant<kQ4_1, 3, 1>,
                                     few_quant<kQ4_1, 4, 1>};
    static constexpr Few q8_np[] = {nullptr, few_quant<kQ8_0, 1, 2>, few_quant<kQ8_0, 2, 2>, few_quant<kQ8_0, 3, 1>,
                                    few_quant<kQ8_0, 4, 1>};
    static constexpr Few q8_one[] = {nullptr, few_quant<kQ8_0, 1, 1>, few_quant<kQ8_0, 2, 1>, few_quant<kQ8_0, 3, 1>,
                                     few_quant<kQ8_0, 4, 1>};
    static constexpr Few bf_np[] = {nullptr, few_quant<kBF16, 1, 2>, few_quant<kBF16, 2, 2>, few_quant<kBF16, 3, 1>,
                                    few_quant<kBF16, 4, 1>};
    static constexpr Few bf_one[] = {nullptr, few_quant<kBF16, 1, 1>, few_quant<kBF16, 2, 1>, few_quant<kBF16, 3, 1>,
                                     few_quant<kBF16, 4, 1>};
    const bool wide = avx512::enabled();
    const Few* np = wide ? avx512::few_quant(format, true) : format == kQ4_1 ? q4_np : format == kQ8_0 ? q8_np : bf_np;
    const Few* one = wide ? avx512::few_quant(format, false) : format == kQ4_1 ? q4_one : format == kQ8_0 ? q8_one
                                                                                                       : bf_one;
    run_few(np, one, wide ? avx512::kFewPanels : kFewPanels, static_cast<int>(m), x, k, packed, nb * bytes, nb * bytes,
            n, bias, y, threads);
    return;
  }
  const bool wide = avx512::enabled();
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t p = 0; p < n / kPanel; ++p) {
    alignas(64) float scratch[kChunk * kPanel];  // one k-chunk of this panel, dequantized (16 KB: stays in L1)
    const uint8_t* panel = packed + p * nb * bytes;
    const float* b = bias ? bias + p * kPanel : nullptr;
    for (int64_t k0 = 0; k0 < k; k0 += kChunk) {
      const int64_t k1 = k0 + kChunk < k ? k0 + kChunk : k;
      if (kquant) {
        adaflash::kquant::dequant(format, panel, k0 / kBlock, k1 / kBlock, scratch);
        (wide ? avx512::chunk_rows : chunk_rows)(x, m, k, scratch, k0, k1, y + p * kPanel, n, b);
      } else if (wide) {
        avx512::dequant(format, panel, k0 / kBlock, k1 / kBlock, scratch);
        avx512::chunk_rows(x, m, k, scratch, k0, k1, y + p * kPanel, n, b);
      } else {
        dequant(format, panel, k0 / kBlock, k1 / kBlock, scratch);
        chunk_rows(x, m, k, scratch, k0, k1, y + p * kPanel, n, b);
      }
    }
  }
}

}  // extern "C"
