// Attention of a few new queries per sequence (decode steps, verification and draft blocks) over each sequence's
// own cached keys, read in place from the slot cache: no padding to the batch's longest sequence, no mask tensor,
// and the query heads sharing a KV head read it together (GQA).
//
// Why own it: batched decode attention is the KV cache streamed once per step, and SDPA over a padded
// [n, heads, qmax, key_len] batch ran at ~4 GB/s here. Each query row's result depends only on that row, its keys
// and their order (never on the other rows or sequences of the batch), so a token gets bitwise the same attention
// alone or in any batch this kernel runs (RaggedAttention sends a batch with a prefill-length query to SDPA).
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <vector>

#include "simd_math.h"

namespace {

using adaflash::exp_nonpositive;
using adaflash::hsum;

// One query row: out[d] = sum_j softmax(q . k_j * scale)_j v_j over keys j < len. d % 8 == 0.
void attend_row(const float* q, const float* k, const float* v, int64_t len, int64_t d, float scale, float* scores,
                float* out) {
  // Scores, 8 keys at a time: 8 dot products in 8 accumulators, then one transposing reduction.
  __m256 vmax8 = _mm256_set1_ps(-INFINITY);
  int64_t j0 = 0;
  for (; j0 + 8 <= len; j0 += 8) {
    __m256 acc[8];
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) acc[u] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
      const __m256 qi = _mm256_loadu_ps(q + i);
#pragma GCC unroll 8
      for (int u = 0; u < 8; ++u) acc[u] = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k + (j0 + u) * d + i), acc[u]);
    }
    const __m256 h01 = _mm256_hadd_ps(acc[0], acc[1]), h23 = _mm256_hadd_ps(acc[2], acc[3]);
    const __m256 h45 = _mm256_hadd_ps(acc[4], acc[5]), h67 = _mm256_hadd_ps(acc[6], acc[7]);
    const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
    // lanes: [k0 k1 k2 k3 | k0 k1 k2 k3] halves of h0123 (and k4..k7 for h4567): add the two 128-bit halves.
    const __m256 sums =
        _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
    const __m256 sc = _mm256_mul_ps(sums, _mm256_set1_ps(scale));
    _mm256_storeu_ps(scores + j0, sc);
    vmax8 = _mm256_max_ps(vmax8, sc);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax8);
  float max = lanes[0];
  for (int u = 1; u < 8; ++u) max = lanes[u] > max ? lanes[u] : max;
  for (int64_t j = j0; j < len; ++j) {  // the last len % 8 keys one by one
    const float* kj = k + j * d;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(kj + i), acc);
    const float sc = hsum(acc) * scale;
    scores[j] = sc;
    max = sc > max ? sc : max;
  }
  // Probabilities, summed in 8 lanes then reduced (a fixed order for a given len).
  const __m256 vmax = _mm256_set1_ps(max);
  __m256 vsum = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= len; j += 8) {
    const __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + j), vmax));
    _mm256_storeu_ps(scores + j, p);
    vsum = _mm256_add_ps(vsum, p);
  }
  float sum = hsum(vsum);
  if (j < len) {
    alignas(32) float tail[8] = {0};
    for (int64_t t = j; t < len; ++t) tail[t - j] = scores[t] - max;
    for (int64_t t = len - j; t < 8; ++t) tail[t] = -INFINITY;
    const __m256 p = exp_nonpositive(_mm256_load_ps(tail));
    _mm256_store_ps(tail, p);
    for (int64_t t = j; t < len; ++t) scores[t] = tail[t - j], sum += tail[t - j];
  }
  // out = sum_j p_j v_j / sum, 64 lanes of d at a time kept in registers.
  for (int64_t i0 = 0; i0 < d; i0 += 64) {
    const int64_t width = d - i0 < 64 ? d - i0 : 64;
    const int vecs = static_cast<int>(width / 8);
    __m256 acc[8];
    for (int u = 0; u < 8; ++u) acc[u] = _mm256_setzero_ps();
    for (int64_t jj = 0; jj < len; ++jj) {
      const __m256 p = _mm256_set1_ps(scores[jj]);
      const float* vj = v + jj * d + i0;
#pragma GCC unroll 8
      for (int u = 0; u < 8; ++u)
        if (u < vecs) acc[u] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + u * 8), acc[u]);
    }
    const __m256 denom = _mm256_set1_ps(sum);
    for (int u = 0; u < vecs; ++u) _mm256_storeu_ps(out + i0 + u * 8, _mm256_div_ps(acc[u], denom));
  }
}

}  // namespace

extern "C" {

// q: [T, heads, d] (the batch's new tokens, sequence by sequence); k, v: one layer of the slot cache,
// [slots, kv_heads, max_len, d]; sequence s owns tokens [token_start[s], token_start[s + 1]) and cache slot
// slot[s]; token t attends keys [0, key_len[t]) of its slot. out: [T, heads, d]. heads % kv_heads == 0, d % 8 == 0.
void adaflash_ragged_attention(const float* q, int64_t heads, int64_t d, const float* k, const float* v,
                               int64_t kv_heads, int64_t max_len, int64_t num_seqs, const int64_t* token_start,
                               const int64_t* slot, const int64_t* key_len, float scale, float* out, int threads) {
  const int64_t groups = heads / kv_heads;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scores(max_len);
#pragma omp for schedule(dynamic, 1) collapse(2)
    for (int64_t s = 0; s < num_seqs; ++s) {
      for (int64_t h = 0; h < kv_heads; ++h) {
        const float* ks = k + (slot[s] * kv_heads + h) * max_len * d;
        const float* vs = v + (slot[s] * kv_heads + h) * max_len * d;
        for (int64_t t = token_start[s]; t < token_start[s + 1]; ++t) {
          for (int64_t g = 0; g < groups; ++g) {
            const int64_t row = t * heads + h * groups + g;  // query head h * groups + g reads KV head h
            attend_row(q + row * d, ks, vs, key_len[t], d, scale, scores.data(), out + row * d);
          }
        }
      }
    }
  }
}

}  // extern "C"
