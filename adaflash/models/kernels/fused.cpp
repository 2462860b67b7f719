// Small fused steps of a decoder layer, where a decode step's time goes to per-op overhead, not arithmetic:
// torch's CPU rms_norm costs ~20 us a call at one row (dtype dispatch, five kernels) and the RoPE + cache write of
// q/k/v some 25 small ops per layer.
//
// RMSNorm over fp32 rows: out = x * (1 / sqrt(mean(x^2) + eps)) * w, as transformers' Llama/Qwen RMSNorm computes it
// (the mean here sums in 8 lanes, then across them: close to torch's rms_norm, not bitwise - the autograd path and
// ADAFLASH_KERNELS=stock keep torch's, so they round the last bits differently).
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <omp.h>
#include <type_traits>
#include <vector>

#include "simd_math.h"

namespace {

// A cache element from an fp32 value: itself, or fp16 / bf16 rounded to nearest even (as torch's .to(float16) and
// .to(bfloat16)).
inline void store(float* dst, float x) { *dst = x; }
inline void store(uint16_t* dst, float x) {
  *dst = static_cast<uint16_t>(_mm_extract_epi16(_mm_cvtps_ph(_mm_set_ss(x), _MM_FROUND_TO_NEAREST_INT), 0));
}
inline void store(adaflash::bf16* dst, float x) { *dst = adaflash::to_bf16(x); }

// One head's row of hd values into the cache (an int8 cache: rounded to nearest even after dividing by the row's
// scale, max |x| / 127, written to `scale`, as the torch path computes it: KVCache.write_rows).
template <typename KV>
void put_row(KV* y, float* scale, const float* x, int64_t hd) {
  if constexpr (std::is_same<KV, int8_t>::value) {
    float amax = 0.0f;
    for (int64_t i = 0; i < hd; ++i) amax = std::fabs(x[i]) > amax ? std::fabs(x[i]) : amax;
    const float s = amax / 127.0f;
    *scale = s;
    for (int64_t i = 0; i < hd; ++i) y[i] = s == 0.0f ? 0 : static_cast<int8_t>(std::nearbyint(x[i] / s));
  } else {
    for (int64_t i = 0; i < hd; ++i) store(y + i, x[i]);
  }
}

template <typename KV>
void rope_qkv(const float* qkv, int64_t tokens, int64_t nq, int64_t nkv, int64_t hd, const float* cos,
              const float* sin, KV* k_cache, KV* v_cache, float* k_scale, float* v_scale, int64_t block_shift,
              int64_t table_len, const int64_t* tables, const int64_t* slot, const int64_t* position, float* q_out) {
  const int64_t half = hd / 2, width = (nq + 2 * nkv) * hd, block = int64_t{1} << block_shift;
  thread_local std::vector<float> rotated;
  rotated.resize(hd);
  for (int64_t t = 0; t < tokens; ++t) {
    // The token's row in its block: head h at ((block * nkv + h) * block size + row) * hd (its scale at that row).
    const int64_t blk = tables[slot[t] * table_len + (position[t] >> block_shift)];
    const int64_t within = position[t] & (block - 1);
    const float* row = qkv + t * width;
    const float* c = cos + t * hd;
    const float* s = sin + t * hd;
    for (int64_t h = 0; h < nq + nkv; ++h) {
      const float* x = row + h * hd;
      float* y = h < nq ? q_out + (t * nq + h) * hd : rotated.data();
      for (int64_t i = 0; i < half; ++i) y[i] = x[i] * c[i] + (-x[i + half]) * s[i];
      for (int64_t i = half; i < hd; ++i) y[i] = x[i] * c[i] + x[i - half] * s[i];
      if (h >= nq) {
        const int64_t at = (blk * nkv + (h - nq)) * block + within;
        put_row(k_cache + at * hd, k_scale ? k_scale + at : nullptr, y, hd);
      }
    }
    for (int64_t h = 0; h < nkv; ++h) {
      const int64_t at = (blk * nkv + h) * block + within;
      put_row(v_cache + at * hd, v_scale ? v_scale + at : nullptr, row + (nq + nkv + h) * hd, hd);
    }
  }
}

}  // namespace

extern "C" {

void adaflash_rms_norm(const float* x, int64_t rows, int64_t d, const float* w, float eps, float* out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows >= 64)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * d;
    float* yr = out + r * d;
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) {
      const __m256 v = _mm256_loadu_ps(xr + i);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc);
    float sum = 0.0f;
    for (int u = 0; u < 8; ++u) sum += lanes[u];
    for (; i < d; ++i) sum += xr[i] * xr[i];
    const float scale = 1.0f / std::sqrt(sum / static_cast<float>(d) + eps);
    const __m256 vs = _mm256_set1_ps(scale);
    for (i = 0; i + 8 <= d; i += 8)
      _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), vs), _mm256_loadu_ps(w + i)));
    for (; i < d; ++i) yr[i] = xr[i] * scale * w[i];
  }
}

// The fused q/k/v projection's output [T, (nq + 2 nkv) * hd] -> RoPE'd queries q_out [T, nq, hd], RoPE'd keys and
// the values written into one layer of the paged cache ([blocks, nkv, 1 << block_shift, hd] of kv_type: 0 fp32,
// 1 fp16, 2 bf16, 3 int8 with a scale a row in k_scale / v_scale ([blocks, nkv, 1 << block_shift], else null);
// `tables`: per slot table_len blocks) at each token's slot and position. RoPE (half-split, as HF checkpoints use):
// y = x * cos + rotate_half(x) * sin, each
// product and the sum rounded as torch computes them (built with -ffp-contract=off), so the values are bitwise the
// unfused path's (a 16-bit cache: then rounded as torch's .to() rounds).
void adaflash_rope_qkv(const float* qkv, int64_t tokens, int64_t nq, int64_t nkv, int64_t hd, const float* cos,
                       const float* sin, void* k_cache, void* v_cache, float* k_scale, float* v_scale,
                       int64_t block_shift, int64_t table_len, const int64_t* tables, const int64_t* slot,
                       const int64_t* position, float* q_out, int kv_type) {
#define ADAFLASH_ROPE(KV)                                                                                           \
  rope_qkv(qkv, tokens, nq, nkv, hd, cos, sin, static_cast<KV*>(k_cache), static_cast<KV*>(v_cache), k_scale,     \
           v_scale, block_shift, table_len, tables, slot, position, q_out)
  if (kv_type == 1)
    ADAFLASH_ROPE(uint16_t);
  else if (kv_type == 2)
    ADAFLASH_ROPE(adaflash::bf16);
  else if (kv_type == 3)
    ADAFLASH_ROPE(int8_t);
  else
    ADAFLASH_ROPE(float);
#undef ADAFLASH_ROPE
}

// The MLP's activation over the fused gate/up projection [rows, 2 * inter] (gate first, as the weights are stacked):
// out[rows, inter] = silu(gate) * up, silu(g) = g * sigmoid(g) with sigmoid from e = exp(-|g|) (never overflows):
// 1 / (1 + e) for g >= 0, e / (1 + e) below. ~1 ulp from torch's silu, not bitwise (the stock path keeps torch's).
void adaflash_silu_mul(const float* gate_up, int64_t rows, int64_t inter, float* out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows >= 16)
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate_up + r * 2 * inter;
    const float* u = g + inter;
    float* y = out + r * inter;
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    int64_t i = 0;
    for (; i + 8 <= inter; i += 8) {
      const __m256 x = _mm256_loadu_ps(g + i);
      const __m256 e = adaflash::exp_nonpositive(_mm256_or_ps(x, sign));  // exp(-|x|)
      const __m256 r1 = _mm256_div_ps(one, _mm256_add_ps(one, e));
      const __m256 sig = _mm256_blendv_ps(r1, _mm256_mul_ps(e, r1), x);  // x's sign bit set: e / (1 + e)
      _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + i)));
    }
    for (; i < inter; ++i) y[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  }
}

// Greedy decoding's argmax over each fp32 row of logits [rows, cols]: the index of the first largest value, as
// torch.argmax returns it (a NaN counts as the largest: the first NaN's index), paid per decoded and per verified row.
// Two vectorised passes: the largest value (four independent max chains, so the loop runs at the loads' pace, not
// max's latency), then the first position holding it, 8 lanes a compare: ~5 us for one 49152-column row in cache on
// an AMD EPYC, where one max chain and a scalar search took ~25 us and torch's argmax ~40 us.
int64_t argmax_row(const float* x, int64_t cols) {
  __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0, unordered = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= cols; i += 32) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
    const __m256 c = _mm256_loadu_ps(x + i + 16), d = _mm256_loadu_ps(x + i + 24);
    m0 = _mm256_max_ps(m0, a);
    m1 = _mm256_max_ps(m1, b);
    m2 = _mm256_max_ps(m2, c);
    m3 = _mm256_max_ps(m3, d);
    const __m256 nan_ab = _mm256_cmp_ps(a, b, _CMP_UNORD_Q), nan_cd = _mm256_cmp_ps(c, d, _CMP_UNORD_Q);
    unordered = _mm256_or_ps(unordered, _mm256_or_ps(nan_ab, nan_cd));
  }
  for (; i + 8 <= cols; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    m0 = _mm256_max_ps(m0, v);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
  float best = lanes[0];
  for (int u = 1; u < 8; ++u) best = lanes[u] > best ? lanes[u] : best;
  bool has_nan = _mm256_movemask_ps(unordered) != 0;
  for (; i < cols; ++i) {
    has_nan = has_nan || std::isnan(x[i]);
    best = x[i] > best ? x[i] : best;
  }
  // -0 == +0: the first zero of either sign, as torch.
  const __m256 wanted = _mm256_set1_ps(best);
  int64_t at = -1, j = 0;
  for (; at < 0 && j + 8 <= cols; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    const __m256 hit = has_nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, wanted, _CMP_EQ_OQ);
    const int hits = _mm256_movemask_ps(hit);
    if (hits) at = j + __builtin_ctz(static_cast<unsigned>(hits));
  }
  for (; at < 0 && j < cols; ++j) {
    if (has_nan ? std::isnan(x[j]) : x[j] == best) at = j;
  }
  return at < 0 ? cols - 1 : at;
}

void adaflash_argmax_rows(const float* x, int64_t rows, int64_t cols, int64_t* out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows >= 8)
  for (int64_t r = 0; r < rows; ++r) out[r] = argmax_row(x + r * cols, cols);
}

// The benchmarks' memory-bandwidth probe: reads bytes (a multiple of 128) once with AVX2 loads on `threads` threads,
// each a contiguous share, and returns a checksum that keeps the reads (runtime_speed.py takes the faster of this and
// torch's fp32 sum, whose adds may bound it below the memory's speed).
uint64_t adaflash_stream_read(const uint8_t* p, int64_t bytes, int threads) {
  uint64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    const int t = omp_get_thread_num(), n = omp_get_num_threads();
    const int64_t lines = bytes / 128, lo = lines * t / n * 128, hi = lines * (t + 1) / n * 128;
    __m256i acc = _mm256_setzero_si256();
    for (int64_t i = lo; i < hi; i += 128) {
      const __m256i* q = reinterpret_cast<const __m256i*>(p + i);
      const __m256i a = _mm256_add_epi8(_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1));
      const __m256i b = _mm256_add_epi8(_mm256_loadu_si256(q + 2), _mm256_loadu_si256(q + 3));
      acc = _mm256_add_epi8(acc, _mm256_add_epi8(a, b));
    }
    alignas(32) uint64_t lanes[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc);
    total += lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3];
  }
  return total;
}

}  // extern "C"
