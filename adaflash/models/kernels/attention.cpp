// Attention of a few new queries per sequence (decode steps, verification and draft blocks) over each sequence's
// own cached keys, read in place from the slot cache: no padding to the batch's longest sequence, no mask tensor,
// and the query heads sharing a KV head read it together (GQA).
//
// Why own it: batched decode attention is the KV cache streamed once per step, and SDPA over a padded
// [n, heads, qmax, key_len] batch ran at ~4 GB/s here. Each query row's result depends only on that row, its keys
// and their order (never on the other rows or sequences of the batch), so a token gets bitwise the same attention
// alone or in any batch this kernel runs (RaggedAttention sends a batch with a prefill-length query to SDPA).
//
// The cache holds fp32, or fp16 (the int8 target's: what batched decode streams is halved, as in llama.cpp's
// default cache); fp16 values widen exactly, so the arithmetic after the load is the same for both.
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <vector>

#include "simd_math.h"

namespace {

using adaflash::exp_nonpositive;
using adaflash::hsum;

// scores[0, len) -> exp(score - max) in place; returns their sum, added in 8 lanes then reduced (a fixed order for a
// given len).
inline float softmax_in_place(float* scores, int64_t len, float max) {
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
  return sum;
}

constexpr int64_t kKeysAhead = 8;  // the score pass's software prefetch distance, in keys

// 8 cache values as fp32 (fp16 widened exactly).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// Scores of R query rows that read the same keys (the query heads of one token that share a KV head, GQA) for keys
// [j_begin, j_end) of a sequence's len: scores_r[j] = q_r . k_j * scale; returns each row's maximum over the range in
// max[r]. j_begin % 8 == 0, d % 8 == 0. Each key row is loaded once for all R rows. Every score's arithmetic is the same
// whatever R or the range: one FMA chain per lane over d in order, then a fixed reduction tree; keys below a multiple
// of 8 (`blocked`, len / 8 * 8) take the 4-key tree, the rest one by one - the split the 8-key version of this kernel
// had, so every score keeps its bits.
template <int R, typename KV>
void score_keys(const float* const* q, const KV* k, const KV* v, int64_t j_begin, int64_t j_end, int64_t len,
                int64_t d, float scale, float* const* scores, float* max) {
  // 4 keys at a time for the R rows (3 x 4 accumulators, the rows' q vectors and a key vector: 16 registers).
  __m128 vmax4[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) vmax4[r] = _mm_set1_ps(-INFINITY);
  const int64_t blocked = len / 8 * 8, tree_end = j_end < blocked ? j_end : blocked;
  for (int64_t j0 = j_begin; j0 < tree_end; j0 += 4) {
    // Software prefetch: the keys kKeysAhead rows on into L1, and these 4 keys' values into L2 for the output pass
    // (a sequence's KV head is a short stream the hardware prefetcher barely ramps up on). Batched decode steps
    // 0.90-0.97x the time (docs/results/session17/attention_prefetch_ab.txt); the values' prefetch is most of it.
    for (int64_t c = 0; c < 4 * d * static_cast<int64_t>(sizeof(KV)); c += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(k + (j0 + kKeysAhead) * d) + c, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(v + j0 * d) + c, _MM_HINT_T1);
    }
    __m256 acc[R][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) acc[r][u] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
      __m256 qi[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) qi[r] = _mm256_loadu_ps(q[r] + i);
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) {
        const __m256 ku = load8(k + (j0 + u) * d + i);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) acc[r][u] = _mm256_fmadd_ps(qi[r], ku, acc[r][u]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      // Per key: ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) of its 8 lanes.
      const __m256 h0123 = _mm256_hadd_ps(_mm256_hadd_ps(acc[r][0], acc[r][1]), _mm256_hadd_ps(acc[r][2], acc[r][3]));
      const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(h0123), _mm256_extractf128_ps(h0123, 1));
      const __m128 sc = _mm_mul_ps(sums, _mm_set1_ps(scale));
      _mm_storeu_ps(scores[r] + j0, sc);
      vmax4[r] = _mm_max_ps(vmax4[r], sc);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    alignas(16) float lanes[4];
    _mm_store_ps(lanes, vmax4[r]);
    float m = lanes[0];
    for (int u = 1; u < 4; ++u) m = lanes[u] > m ? lanes[u] : m;
    for (int64_t j = j_begin > blocked ? j_begin : blocked; j < j_end; ++j) {  // the last len % 8 keys one by one
      const KV* kj = k + j * d;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q[r] + i), load8(kj + i), acc);
      const float sc = hsum(acc) * scale;
      scores[r][j] = sc;
      m = sc > m ? sc : m;
    }
    max[r] = m;
  }
}

// out_r[i0, i0 + 32) = sum_j p_rj v_j / sum_r over keys j < len, for the R rows (p: softmax_in_place's numerators).
// Each output lane is one FMA chain over the keys in order, whichever lanes a call takes.
template <int R, typename KV>
void output_lanes(const float* const* p, const KV* v, int64_t len, int64_t d, int64_t i0, const float* sum,
                  float* const* out) {
  const int vecs = static_cast<int>((d - i0 < 32 ? d - i0 : 32) / 8);
  __m256 acc[R][4];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) acc[r][u] = _mm256_setzero_ps();
  for (int64_t jj = 0; jj < len; ++jj) {
    __m256 pj[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) pj[r] = _mm256_set1_ps(p[r][jj]);
    const KV* vj = v + jj * d + i0;
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      if (u < vecs) {
        const __m256 vu = load8(vj + u * 8);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) acc[r][u] = _mm256_fmadd_ps(pj[r], vu, acc[r][u]);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const __m256 denom = _mm256_set1_ps(sum[r]);
    for (int u = 0; u < vecs; ++u) _mm256_storeu_ps(out[r] + i0 + u * 8, _mm256_div_ps(acc[r][u], denom));
  }
}

// R rows over keys [0, len) in one go: scores, softmax, outputs (the K/V head stays in this core's caches).
template <int R, typename KV>
void attend_rows(const float* const* q, const KV* k, const KV* v, int64_t len, int64_t d, float scale,
                 float* const* scores, float* const* out) {
  float max[R], sum[R];
  score_keys<R>(q, k, v, 0, len, len, d, scale, scores, max);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) sum[r] = softmax_in_place(scores[r], len, max[r]);
  for (int64_t i0 = 0; i0 < d; i0 += 32) output_lanes<R>(scores, v, len, d, i0, sum, out);
}

constexpr int kMaxRows = 3;
// Keys per task of the split path's score pass (a multiple of 8: a task's keys take the same tree as in one pass).
constexpr int64_t kSplitKeys = 256;
// The split path's three passes cost more than they save on short sequences (a batch-1 step over 64 keys 1.14x, 256
// keys 1.06x the time of one pass per group; 1024 keys 0.91x).
constexpr int64_t kSplitMinKeys = 512;

// One token's query heads of one KV head (up to kMaxRows of them): the unit every path computes the same way.
struct RowGroup {
  int64_t token, first_row, len;  // rows first_row ... of q / out ([T * heads] rows of d)
  int rows;
  int64_t kv_offset;  // of the group's KV head in one layer of the cache, in elements
};

template <typename KV>
struct Kernels {
  using Score = void (*)(const float* const*, const KV*, const KV*, int64_t, int64_t, int64_t, int64_t, float,
                         float* const*, float*);
  using Output = void (*)(const float* const*, const KV*, int64_t, int64_t, int64_t, const float*, float* const*);
  using Attend = void (*)(const float* const*, const KV*, const KV*, int64_t, int64_t, float, float* const*,
                          float* const*);
  static constexpr Score score[kMaxRows + 1] = {nullptr, score_keys<1, KV>, score_keys<2, KV>, score_keys<3, KV>};
  static constexpr Output output[kMaxRows + 1] = {nullptr, output_lanes<1, KV>, output_lanes<2, KV>,
                                                  output_lanes<3, KV>};
  static constexpr Attend attend[kMaxRows + 1] = {nullptr, attend_rows<1, KV>, attend_rows<2, KV>,
                                                  attend_rows<3, KV>};
};

// Few row groups (a batch-1 decode step: one per KV head, fewer than two per thread): a group a task left one core
// idle while the other streamed two KV heads (1 thread ran such a step as fast as 2). Here the score pass splits each
// group's keys into tasks of kSplitKeys, the softmax goes row by row, and the output pass splits d into 32-lane
// tasks - every value computed by the same instructions as in attend_rows, so the bits are the same.
template <typename KV>
void split_attention(const float* q, const KV* k, const KV* v, int64_t d, float scale, float* out,
                     const std::vector<RowGroup>& groups, int threads) {
  using K = Kernels<KV>;
  const int64_t n = static_cast<int64_t>(groups.size());
  int64_t max_len = 0;
  for (const RowGroup& g : groups) max_len = g.len > max_len ? g.len : max_len;
  const int64_t blocks = (max_len + kSplitKeys - 1) / kSplitKeys, lane_tasks = (d + 31) / 32;
  // The calling thread's buffers, shared by the team: every group's score rows, per-block maxima, sums.
  static thread_local std::vector<float> scores, maxima, sums;
  if (static_cast<int64_t>(scores.size()) < n * kMaxRows * max_len) scores.resize(n * kMaxRows * max_len);
  if (static_cast<int64_t>(maxima.size()) < n * blocks * kMaxRows) maxima.resize(n * blocks * kMaxRows);
  if (static_cast<int64_t>(sums.size()) < n * kMaxRows) sums.resize(n * kMaxRows);
  float* score_base = scores.data();
  float* max_base = maxima.data();
  float* sum_base = sums.data();
  auto rows_of = [&](const RowGroup& g, const float* base, int64_t stride, const float** rows) {
    for (int r = 0; r < g.rows; ++r) rows[r] = base + (g.first_row + r) * stride;
  };
  auto score_rows = [&](int64_t gi, float** rows) {
    for (int r = 0; r < kMaxRows; ++r) rows[r] = score_base + (gi * kMaxRows + r) * max_len;
  };
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(dynamic, 1) collapse(2)
    for (int64_t gi = 0; gi < n; ++gi) {
      for (int64_t b = 0; b < blocks; ++b) {
        const RowGroup& g = groups[gi];
        const int64_t j_begin = b * kSplitKeys, j_end = j_begin + kSplitKeys < g.len ? j_begin + kSplitKeys : g.len;
        float* block_max = max_base + (gi * blocks + b) * kMaxRows;
        if (j_begin >= g.len) {
          for (int r = 0; r < g.rows; ++r) block_max[r] = -INFINITY;
          continue;
        }
        const float* q_rows[kMaxRows];
        float* s_rows[kMaxRows];
        rows_of(g, q, d, q_rows);
        score_rows(gi, s_rows);
        K::score[g.rows](q_rows, k + g.kv_offset, v + g.kv_offset, j_begin, j_end, g.len, d, scale, s_rows,
                         block_max);
      }
    }
#pragma omp for schedule(dynamic, 1) collapse(2)
    for (int64_t gi = 0; gi < n; ++gi) {
      for (int r = 0; r < kMaxRows; ++r) {
        const RowGroup& g = groups[gi];
        if (r >= g.rows) continue;
        float max = -INFINITY;  // a maximum is exact in any order: the fused pass's value
        for (int64_t b = 0; b < blocks; ++b) {
          const float m = max_base[(gi * blocks + b) * kMaxRows + r];
          max = m > max ? m : max;
        }
        sum_base[gi * kMaxRows + r] = softmax_in_place(score_base + (gi * kMaxRows + r) * max_len, g.len, max);
      }
    }
#pragma omp for schedule(dynamic, 1) collapse(2)
    for (int64_t gi = 0; gi < n; ++gi) {
      for (int64_t lt = 0; lt < lane_tasks; ++lt) {
        const RowGroup& g = groups[gi];
        float* s_rows[kMaxRows];
        float* out_rows[kMaxRows];
        score_rows(gi, s_rows);
        for (int r = 0; r < g.rows; ++r) out_rows[r] = out + (g.first_row + r) * d;
        K::output[g.rows](s_rows, v + g.kv_offset, g.len, d, lt * 32, sum_base + gi * kMaxRows, out_rows);
      }
    }
  }
}

// The cache's rows for every query token of the batch (see adaflash_ragged_attention), with KV its element type.
template <typename KV>
void ragged_attention(const float* q, int64_t heads, int64_t d, const KV* k, const KV* v, int64_t kv_heads,
                      int64_t max_len, int64_t num_seqs, const int64_t* token_start, const int64_t* slot,
                      const int64_t* key_len, float scale, float* out, int threads) {
  using K = Kernels<KV>;
  const int64_t groups = heads / kv_heads;
  // A token's query heads of one KV head in chunks of up to kMaxRows rows, as even as they go (4 heads: 2 + 2).
  const int64_t chunks = (groups + kMaxRows - 1) / kMaxRows, per_chunk = (groups + chunks - 1) / chunks;
  const int64_t tokens = token_start[num_seqs];
  int64_t longest = 0;
  for (int64_t t = 0; t < tokens; ++t) longest = key_len[t] > longest ? key_len[t] : longest;
  if (threads > 1 && tokens * kv_heads * chunks < 2 * threads && longest >= kSplitMinKeys) {
    static thread_local std::vector<RowGroup> list;
    list.clear();
    for (int64_t s = 0; s < num_seqs; ++s)
      for (int64_t h = 0; h < kv_heads; ++h)
        for (int64_t t = token_start[s]; t < token_start[s + 1]; ++t)
          for (int64_t g0 = 0; g0 < groups; g0 += per_chunk)
            list.push_back({t, t * heads + h * groups + g0, key_len[t],
                            static_cast<int>(groups - g0 < per_chunk ? groups - g0 : per_chunk),
                            (slot[s] * kv_heads + h) * max_len * d});
    split_attention(q, k, v, d, scale, out, list, threads);
    return;
  }
  // Otherwise a task is one KV head of a sequence for a contiguous part of its tokens: whole sequences where there are
  // enough of them (a batched decode step), a verification's or prefill's tokens spread over the threads (one task per
  // KV head ran a 16-token verification on one core for two of its three heads).
  const int64_t per_seq_head = num_seqs * kv_heads;
  const int64_t parts = (4 * threads + per_seq_head - 1) / per_seq_head;
#pragma omp parallel num_threads(threads)
  {
    // Per thread, kept between calls: a fresh zero-filled vector was 3 x max_len floats per thread per layer (with a
    // 4096-position cache, 1.4 MB written every decode step).
    static thread_local std::vector<float> scores;
    if (static_cast<int64_t>(scores.size()) < kMaxRows * max_len) scores.resize(kMaxRows * max_len);
    float* score_rows[kMaxRows];
    for (int r = 0; r < kMaxRows; ++r) score_rows[r] = scores.data() + r * max_len;
#pragma omp for schedule(dynamic, 1) collapse(3)
    for (int64_t s = 0; s < num_seqs; ++s) {
      for (int64_t h = 0; h < kv_heads; ++h) {
        for (int64_t part = 0; part < parts; ++part) {
          const KV* ks = k + (slot[s] * kv_heads + h) * max_len * d;
          const KV* vs = v + (slot[s] * kv_heads + h) * max_len * d;
          const int64_t n = token_start[s + 1] - token_start[s];
          for (int64_t t = token_start[s] + n * part / parts; t < token_start[s] + n * (part + 1) / parts; ++t) {
            for (int64_t g0 = 0; g0 < groups; g0 += per_chunk) {
              const int rows = static_cast<int>(groups - g0 < per_chunk ? groups - g0 : per_chunk);
              const float* q_rows[kMaxRows];
              float* out_rows[kMaxRows];
              for (int r = 0; r < rows; ++r) {
                const int64_t row = t * heads + h * groups + g0 + r;  // query head h * groups + g reads KV head h
                q_rows[r] = q + row * d;
                out_rows[r] = out + row * d;
              }
              K::attend[rows](q_rows, ks, vs, key_len[t], d, scale, score_rows, out_rows);
            }
          }
        }
      }
    }
  }
}

}  // namespace

extern "C" {

// q: [T, heads, d] (the batch's new tokens, sequence by sequence); k, v: one layer of the slot cache,
// [slots, kv_heads, max_len, d], fp32 or (kv_half) fp16; sequence s owns tokens [token_start[s], token_start[s + 1])
// and cache slot slot[s]; token t attends keys [0, key_len[t]) of its slot. out: [T, heads, d]. heads % kv_heads ==
// 0, d % 8 == 0.
void adaflash_ragged_attention(const float* q, int64_t heads, int64_t d, const void* k, const void* v,
                               int64_t kv_heads, int64_t max_len, int64_t num_seqs, const int64_t* token_start,
                               const int64_t* slot, const int64_t* key_len, float scale, float* out, int threads,
                               int kv_half) {
  if (kv_half)
    ragged_attention(q, heads, d, static_cast<const uint16_t*>(k), static_cast<const uint16_t*>(v), kv_heads, max_len,
                     num_seqs, token_start, slot, key_len, scale, out, threads);
  else
    ragged_attention(q, heads, d, static_cast<const float*>(k), static_cast<const float*>(v), kv_heads, max_len,
                     num_seqs, token_start, slot, key_len, scale, out, threads);
}

}  // extern "C"
