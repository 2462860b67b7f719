// Attention of a few new queries per sequence (decode steps, verification and draft blocks) over each sequence's
// own cached keys, read in place from the paged cache's blocks through the slot's block table: no padding to the
// batch's longest sequence, no mask tensor, no gathered copy, and the query heads sharing a KV head read it together
// (GQA).
//
// Why own it: batched decode attention is the KV cache streamed once per step, and SDPA over a padded
// [n, heads, qmax, key_len] batch ran at ~4 GB/s here. Each query row's result depends only on that row, its keys
// and their order (never on the other rows or sequences of the batch), so a token gets bitwise the same attention
// alone or in any batch this kernel runs (RaggedAttention sends a batch with a prefill-length query to SDPA).
//
// The cache holds fp32, fp16 (the int8 target's: what batched decode streams is halved, as in llama.cpp's default
// cache) or bf16; both 16-bit types widen exactly, so the arithmetic after the load is the same for all three. Or int8
// rows with one fp32 scale each (a key's or value's head_dim values: llama.cpp's q8_0 with the head as the block): a
// score is q . k8 times the key's scale, a value enters the output weighed by its probability times its scale. A key's
// arithmetic never depends on the block it sits in: the same bits at every block size.
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <type_traits>
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

// 8 cache values as fp32 (fp16 and bf16 widened exactly).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const adaflash::bf16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

template <typename KV>
constexpr bool kScaled = std::is_same<KV, int8_t>::value;  // rows carry a scale each

// One sequence's keys (or values) of one KV head in the paged cache: key j in block table[j >> shift], row
// j & (block size - 1); an int8 cache's row scales in [blocks, kv_heads, block size] beside it. A run of 4 keys
// starting at a multiple of 4 sits in one block (block sizes are powers of two >= 8).
template <typename KV>
struct Rows {
  const KV* base;         // the layer's block 0, this head
  const int64_t* table;   // the sequence's blocks
  int64_t shift, stride;  // log2 block size; elements from one block to the next
  int64_t d;
  const float* scale;     // int8: the layer's block 0 scales, this head (else null)
  int64_t scale_stride;   // int8: scales from one block to the next
  int64_t row(int64_t j) const { return j & ((int64_t{1} << shift) - 1); }
  const KV* at(int64_t j) const { return base + table[j >> shift] * stride + row(j) * d; }
  const float* scale_at(int64_t j) const { return scale + table[j >> shift] * scale_stride + row(j); }
};

// Scores of R query rows that read the same keys (the query heads of one token that share a KV head, GQA) over keys
// j < len: scores_r[j] = q_r . k_j * scale, and each row's maximum in max[r]. d % 8 == 0. Each key row is loaded once
// for all R rows. Every score's arithmetic is the same whatever R: one FMA chain per lane over d in order, then a fixed
// reduction tree; keys below a multiple of 8 take the 4-key tree, the rest one by one - the split the 8-key version of
// this kernel had, so every score keeps its bits.
template <int R, typename KV>
void score_keys(const float* const* q, const Rows<KV>& k, const Rows<KV>& v, int64_t len, int64_t d, float scale,
                float* const* scores, float* max) {
  // 4 keys at a time for the R rows (3 x 4 accumulators, the rows' q vectors and a key vector: 16 registers).
  __m128 vmax4[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) vmax4[r] = _mm_set1_ps(-INFINITY);
  const int64_t blocked = len / 8 * 8;
  const int64_t block = int64_t{1} << k.shift;
  // Block by block (one table lookup for its keys, values and scales), 4 keys at a time in key order.
  for (int64_t b0 = 0; b0 < blocked; b0 += block) {
    const KV* kb = k.at(b0);
    const KV* vb = v.at(b0);
    const KV* k_next = b0 + block < len ? k.at(b0 + block) : kb;  // where the prefetch runs on past this block
    const float* scales = kScaled<KV> ? k.scale_at(b0) : nullptr;
    const int64_t end = b0 + block < blocked ? b0 + block : blocked;
    for (int64_t j0 = b0; j0 < end; j0 += 4) {
      // Software prefetch: the keys kKeysAhead rows on into L1, and these 4 keys' values into L2 for the output pass
      // (a sequence's KV head is a short stream the hardware prefetcher barely ramps up on). Batched decode steps
      // 0.90-0.97x the time (docs/notes.md: attention_prefetch_ab.txt); the values' prefetch is most of it.
      const int64_t row = j0 - b0, ahead = row + kKeysAhead;
      const KV* k4 = kb + row * d;
      const KV* k_far = ahead < block ? kb + ahead * d : k_next + (ahead - block) * d;
      const char* k_ahead = reinterpret_cast<const char*>(k_far);
      const char* v4 = reinterpret_cast<const char*>(vb + row * d);
      for (int64_t c = 0; c < 4 * d * static_cast<int64_t>(sizeof(KV)); c += 64) {
        _mm_prefetch(k_ahead + c, _MM_HINT_T0);
        _mm_prefetch(v4 + c, _MM_HINT_T1);
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
          const __m256 ku = load8(k4 + u * d + i);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) acc[r][u] = _mm256_fmadd_ps(qi[r], ku, acc[r][u]);
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        // Per key: ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) of its 8 lanes.
        const __m256 h0123 =
            _mm256_hadd_ps(_mm256_hadd_ps(acc[r][0], acc[r][1]), _mm256_hadd_ps(acc[r][2], acc[r][3]));
        const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(h0123), _mm256_extractf128_ps(h0123, 1));
        __m128 sc = _mm_mul_ps(sums, _mm_set1_ps(scale));
        if (kScaled<KV>) sc = _mm_mul_ps(sc, _mm_loadu_ps(scales + row));  // the 4 keys' scales
        _mm_storeu_ps(scores[r] + j0, sc);
        vmax4[r] = _mm_max_ps(vmax4[r], sc);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    alignas(16) float lanes[4];
    _mm_store_ps(lanes, vmax4[r]);
    float m = lanes[0];
    for (int u = 1; u < 4; ++u) m = lanes[u] > m ? lanes[u] : m;
    for (int64_t j = blocked; j < len; ++j) {  // the last len % 8 keys one by one
      const KV* kj = k.at(j);
      __m256 acc = _mm256_setzero_ps();
      for (int64_t i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q[r] + i), load8(kj + i), acc);
      const float sc = kScaled<KV> ? hsum(acc) * scale * *k.scale_at(j) : hsum(acc) * scale;
      scores[r][j] = sc;
      m = sc > m ? sc : m;
    }
    max[r] = m;
  }
}

// output_lanes for V vectors of 8 lanes, a count known when compiled (counted at run time per key: 1.02-1.09x the
// time).
template <int R, int V, typename KV>
inline void output_vecs(const float* const* p, const Rows<KV>& v, int64_t len, int64_t d, int64_t i0,
                        const float* sum, float* const* out) {
  __m256 acc[R][V];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int u = 0; u < V; ++u) acc[r][u] = _mm256_setzero_ps();
  const int64_t block = int64_t{1} << v.shift;
  for (int64_t j0 = 0; j0 < len; j0 += block) {  // block by block, each key in order: one FMA chain per lane
    const KV* vb = v.at(j0) + i0;
    const int64_t n = len - j0 < block ? len - j0 : block;
    for (int64_t jj = 0; jj < n; ++jj) {
      __m256 pj[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) pj[r] = _mm256_set1_ps(p[r][j0 + jj]);
      const KV* vj = vb + jj * d;
#pragma GCC unroll 4
      for (int u = 0; u < V; ++u) {
        const __m256 vu = load8(vj + u * 8);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) acc[r][u] = _mm256_fmadd_ps(pj[r], vu, acc[r][u]);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const __m256 denom = _mm256_set1_ps(sum[r]);
#pragma GCC unroll 4
    for (int u = 0; u < V; ++u) _mm256_storeu_ps(out[r] + i0 + u * 8, _mm256_div_ps(acc[r][u], denom));
  }
}

// out_r[i0, i0 + 32) = sum_j p_rj v_j / sum_r over keys j < len, for the R rows (p: softmax_in_place's numerators).
// Each output lane is one FMA chain over the keys in order, whichever lanes a call takes.
template <int R, typename KV>
void output_lanes(const float* const* p, const Rows<KV>& v, int64_t len, int64_t d, int64_t i0, const float* sum,
                  float* const* out) {
  switch ((d - i0 < 32 ? d - i0 : 32) / 8) {
    case 4: return output_vecs<R, 4>(p, v, len, d, i0, sum, out);
    case 3: return output_vecs<R, 3>(p, v, len, d, i0, sum, out);
    case 2: return output_vecs<R, 2>(p, v, len, d, i0, sum, out);
    default: return output_vecs<R, 1>(p, v, len, d, i0, sum, out);
  }
}

#pragma GCC push_options
#pragma GCC target("avx512f")
namespace avx512 {
// The output pass in 16-lane vectors where the CPU has AVX-512: each lane's FMA chain over the keys and its division
// are the same instructions on the same values, so the same bits (tested). A 16-token verification's attention
// 0.89-0.96x the time, batched decode 0.97-0.99x (docs/notes.md: attention_ab.txt). The score pass stays 8
// lanes: with two keys a vector (each key's 8-lane chain kept) it measured 1.02-1.13x slower on top of this, with two
// tokens' chains a vector 0.97-1.03x.
// (::output_vecs in 16-lane types, not one template over both: a template defined under this target would compile the
// 8-lane path with AVX-512 too, and that path must run on AVX2-only CPUs.)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16(const adaflash::bf16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

template <int R, int V, typename KV>
void output_vecs(const float* const* p, const Rows<KV>& v, int64_t len, int64_t d, int64_t i0, const float* sum,
                 float* const* out) {
  __m512 acc[R][V];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int u = 0; u < V; ++u) acc[r][u] = _mm512_setzero_ps();
  const int64_t block = int64_t{1} << v.shift;
  for (int64_t j0 = 0; j0 < len; j0 += block) {
    const KV* vb = v.at(j0) + i0;
    const int64_t n = len - j0 < block ? len - j0 : block;
    for (int64_t jj = 0; jj < n; ++jj) {
      __m512 pj[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) pj[r] = _mm512_set1_ps(p[r][j0 + jj]);
      const KV* vj = vb + jj * d;
#pragma GCC unroll 4
      for (int u = 0; u < V; ++u) {
        const __m512 vu = load16(vj + u * 16);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) acc[r][u] = _mm512_fmadd_ps(pj[r], vu, acc[r][u]);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const __m512 denom = _mm512_set1_ps(sum[r]);
#pragma GCC unroll 4
    for (int u = 0; u < V; ++u) _mm512_storeu_ps(out[r] + i0 + u * 16, _mm512_div_ps(acc[r][u], denom));
  }
}

// As ::output_lanes, in 16-lane vectors (a last 8 lanes by the 8-lane version).
template <int R, typename KV>
void output_lanes(const float* const* p, const Rows<KV>& v, int64_t len, int64_t d, int64_t i0, const float* sum,
                  float* const* out) {
  const int64_t lanes = d - i0 < 32 ? d - i0 : 32;
  if (lanes >= 32) return avx512::output_vecs<R, 2>(p, v, len, d, i0, sum, out);  // (qualified: Rows brings ::'s in)
  if (lanes >= 16) avx512::output_vecs<R, 1>(p, v, len, d, i0, sum, out);
  if (lanes % 16) ::output_vecs<R, 1>(p, v, len, d, i0 + lanes / 16 * 16, sum, out);
}
}  // namespace avx512
#pragma GCC pop_options

bool cpu_has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f");
  return yes;
}
bool allow_avx512 = true;  // tests turn it off to compare the 8-lane path's bits on an AVX-512 CPU

// R rows over keys [0, len) in one go: scores, softmax, outputs (the K/V head stays in this core's caches). Wide: the
// output pass in 16-lane vectors.
template <int R, bool Wide, typename KV>
void attend_rows(const float* const* q, const Rows<KV>& k, const Rows<KV>& v, int64_t len, int64_t d, float scale,
                 float* const* scores, float* const* out) {
  float max[R], sum[R];
  score_keys<R>(q, k, v, len, d, scale, scores, max);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) sum[r] = softmax_in_place(scores[r], len, max[r]);
  if (kScaled<KV>)  // each value's weight: its probability's numerator times its scale (the sum stays the numerators')
    for (int64_t j = 0; j < len; ++j) {
      const float sv = *v.scale_at(j);
      for (int r = 0; r < R; ++r) scores[r][j] *= sv;
    }
  for (int64_t i0 = 0; i0 < d; i0 += 32) {
    if (Wide)
      avx512::output_lanes<R>(scores, v, len, d, i0, sum, out);
    else
      output_lanes<R>(scores, v, len, d, i0, sum, out);
  }
}

constexpr int kMaxRows = 3;

// The cache's rows for every query token of the batch (see adaflash_ragged_attention), with KV its element type.
template <typename KV>
void ragged_attention(const float* q, int64_t heads, int64_t d, const KV* k, const KV* v, int64_t kv_heads,
                      const float* k_scale, const float* v_scale, int64_t block_shift, int64_t table_len,
                      const int64_t* tables, int64_t num_seqs, const int64_t* token_start, const int64_t* slot,
                      const int64_t* key_len, float scale, float* out, int threads) {
  using AttendRows = void (*)(const float* const*, const Rows<KV>&, const Rows<KV>&, int64_t, int64_t, float,
                              float* const*, float* const*);
  static constexpr AttendRows kNarrow[kMaxRows + 1] = {nullptr, attend_rows<1, false, KV>,
                                                       attend_rows<2, false, KV>, attend_rows<3, false, KV>};
  static constexpr AttendRows kWide[kMaxRows + 1] = {nullptr, attend_rows<1, true, KV>, attend_rows<2, true, KV>,
                                                     attend_rows<3, true, KV>};
  const AttendRows* attend = allow_avx512 && cpu_has_avx512() ? kWide : kNarrow;
  const int64_t groups = heads / kv_heads;
  // A token's query heads of one KV head in chunks of up to kMaxRows rows, as even as they go (4 heads: 2 + 2).
  const int64_t chunks = (groups + kMaxRows - 1) / kMaxRows, per_chunk = (groups + chunks - 1) / chunks;
  // A task is one KV head of a sequence for a contiguous part of its tokens: whole sequences where there are
  // enough of them (a batched decode step), a verification's or prefill's tokens spread over the threads (one task per
  // KV head ran a 16-token verification on one core for two of its three heads). ~8 tasks a thread balance them: a
  // batch-1 verification or prefill 0.88-0.95x the time of ~4 (16 alike).
  const int64_t per_seq_head = num_seqs * kv_heads;
  const int64_t parts = (8 * threads + per_seq_head - 1) / per_seq_head;
  const int64_t block_elems = (int64_t{1} << block_shift) * d;
  const int64_t max_len = table_len << block_shift;
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
          const int64_t* table = tables + slot[s] * table_len;
          const int64_t block = int64_t{1} << block_shift;
          const Rows<KV> ks{k + h * block_elems, table, block_shift, kv_heads * block_elems, d,
                            k_scale ? k_scale + h * block : nullptr, kv_heads * block};
          const Rows<KV> vs{v + h * block_elems, table, block_shift, kv_heads * block_elems, d,
                            v_scale ? v_scale + h * block : nullptr, kv_heads * block};
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
              attend[rows](q_rows, ks, vs, key_len[t], d, scale, score_rows, out_rows);
            }
          }
        }
      }
    }
  }
}

}  // namespace

extern "C" {

// allow = 0 runs the 8-lane (AVX2) output pass even where AVX-512 exists (to test that both give the same bits); 1
// restores the default.
void adaflash_attention_allow_avx512(int allow) { allow_avx512 = allow != 0; }

// q: [T, heads, d] (the batch's new tokens, sequence by sequence); k, v: one layer of the paged cache,
// [blocks, kv_heads, 1 << block_shift, d], of kv_type (0 fp32, 1 fp16, 2 bf16, 3 int8 with k_scale / v_scale:
// [blocks, kv_heads, 1 << block_shift] fp32, else null); tables: per slot table_len blocks;
// sequence s owns tokens [token_start[s], token_start[s + 1]) and cache slot slot[s]; token t attends keys
// [0, key_len[t]) of its slot. out: [T, heads, d]. heads % kv_heads == 0, d % 8 == 0.
void adaflash_ragged_attention(const float* q, int64_t heads, int64_t d, const void* k, const void* v,
                               int64_t kv_heads, const float* k_scale, const float* v_scale, int64_t block_shift,
                               int64_t table_len, const int64_t* tables, int64_t num_seqs, const int64_t* token_start,
                               const int64_t* slot, const int64_t* key_len, float scale, float* out, int threads,
                               int kv_type) {
#define ADAFLASH_ATTEND(KV)                                                                                          \
  ragged_attention(q, heads, d, static_cast<const KV*>(k), static_cast<const KV*>(v), kv_heads, k_scale, v_scale, \
                   block_shift, table_len, tables, num_seqs, token_start, slot, key_len, scale, out, threads)
  if (kv_type == 1)
    ADAFLASH_ATTEND(uint16_t);
  else if (kv_type == 2)
    ADAFLASH_ATTEND(adaflash::bf16);
  else if (kv_type == 3)
    ADAFLASH_ATTEND(int8_t);
  else
    ADAFLASH_ATTEND(float);
#undef ADAFLASH_ATTEND
}

}  // extern "C"
