// One whole decoder layer in one call, for steps of up to 16 new tokens per sequence (decode, verify, draft blocks):
// RMSNorm, the fused q/k/v projection, the optional per-head q/k RMSNorm, RoPE + K/V cache write, ragged attention
// (causal or not: each token's key count says), the output projection and residual, RMSNorm, the fused gate/up
// projection, SiLU * up, the down projection and residual. The target's layers and the DFlash drafter's share it.
//
// Why: at one row a decode step's arithmetic is ~10 ms, and the eager Python loop around it added ~5 ms of per-op
// overhead (13 torch or ctypes calls per layer, 30 layers). This calls the very kernels that loop calls, in the same
// order on the same values, so the result is bitwise the loop's (tested): only the dispatch between them is gone.
#include <cstdint>
#include <cstring>
#include <vector>

extern "C" {
void adaflash_rms_norm(const float* x, int64_t rows, int64_t d, const float* w, float eps, float* out, int threads);
void adaflash_rope_qkv(const float* qkv, int64_t tokens, int64_t nq, int64_t nkv, int64_t hd, const float* cos,
                       const float* sin, void* k_cache, void* v_cache, float* k_scale, float* v_scale,
                       int64_t block_shift, int64_t table_len, const int64_t* tables, const int64_t* slot,
                       const int64_t* position, float* q_out, int kv_type);
void adaflash_ragged_attention(const float* q, int64_t heads, int64_t d, const void* k, const void* v,
                               int64_t kv_heads, const float* k_scale, const float* v_scale, int64_t block_shift,
                               int64_t table_len, const int64_t* tables, int64_t num_seqs, const int64_t* token_start,
                               const int64_t* slot, const int64_t* key_len, float scale, float* out, int threads,
                               int kv_type);
void adaflash_silu_mul(const float* gate_up, int64_t rows, int64_t inter, float* out, int threads);
void adaflash_packed_linear(const float* x, int64_t m, int64_t k, const float* packed, int64_t n, const float* bias,
                            float* y, int threads);
void adaflash_quantized_linear(const float* x, int64_t m, int64_t k, const uint8_t* packed, int format, int64_t n,
                               const float* bias, float* y, int threads);
void adaflash_int8_linear(const float* x, int64_t m, int64_t k, const uint8_t* packed, int format, int64_t n,
                          const float* bias, float* y, int threads);
}

namespace {

// Mirrors of the ctypes structures in layer_step.py (same field order and types).
struct Linear {
  const void* packed;  // the kernel's packed weights
  int64_t format;      // 0: packed fp32, 1..15 the quantized kernel's format code, 16 + it the int8 kernel's
  const float* bias;   // [n] or null
  int64_t n, k;
  // A fused weight whose stacked parts came in different formats (a GGUF's q / k in Q4_K, its v in Q6_K): the parts,
  // each its own Linear over the next outputs, and packed / format / bias unused.
  const Linear* parts;
  int64_t num_parts;
};

struct Layer {
  const float* input_norm;
  const float* post_norm;
  const float* q_norm;  // [head_dim] per-head RMSNorm of queries / keys before RoPE (Qwen3, DFlash), or null
  const float* k_norm;
  Linear qkv, o, gate_up, down;
};

// A DFlash draft layer's context projection: its k and v projections stacked ([2 kv_heads head_dim, hidden]).
struct ContextLayer {
  const float* k_norm;  // or null
  Linear kv;
};

struct Shape {
  int64_t hidden, heads, kv_heads, head_dim, intermediate;
  float eps, scale;
};

struct Batch {
  int64_t tokens, num_seqs, layer_stride;  // layer_stride: elements per layer of the K (and V) cache
  int64_t kv_type;                         // the cache's elements: 0 fp32, 1 fp16, 2 bf16, 3 int8 (scaled rows)
  int64_t block_shift, table_len;          // the paged cache's block size (log2) and block-table row length
  const int64_t* tables;                   // per slot its blocks
  int64_t scale_stride;                    // int8: row scales per layer
  void* k_cache;
  void* v_cache;
  float* k_scale;  // int8: [layers, blocks, kv_heads, block size] (else null)
  float* v_scale;
  const float* cos;  // [tokens, head_dim]
  const float* sin;
  const int64_t* token_slot;   // per token: its cache slot
  const int64_t* position;     // per token: its position
  const int64_t* token_start;  // per sequence + 1: its first token
  const int64_t* seq_slot;     // per sequence: its cache slot
  const int64_t* key_len;      // per token: keys it sees
};

void run_linear(const Linear& l, const float* x, int64_t m, float* y, int threads) {
  if (l.parts != nullptr) {  // each part into a scratch, then into its columns of y
    thread_local std::vector<float> part;
    int64_t col = 0;
    for (int64_t i = 0; i < l.num_parts; ++i) {
      const Linear& p = l.parts[i];
      part.resize(m * p.n);
      run_linear(p, x, m, part.data(), threads);
      for (int64_t r = 0; r < m; ++r) std::memcpy(y + r * l.n + col, part.data() + r * p.n, p.n * sizeof(float));
      col += p.n;
    }
    return;
  }
  if (l.format == 0)
    adaflash_packed_linear(x, m, l.k, static_cast<const float*>(l.packed), l.n, l.bias, y, threads);
  else if (l.format >= 16)
    adaflash_int8_linear(x, m, l.k, static_cast<const uint8_t*>(l.packed), static_cast<int>(l.format - 16), l.n,
                         l.bias, y, threads);
  else
    adaflash_quantized_linear(x, m, l.k, static_cast<const uint8_t*>(l.packed), static_cast<int>(l.format), l.n,
                              l.bias, y, threads);
}

// One layer of the K or V cache.
void* layer_of(const Batch* b, void* cache, int64_t layer) {
  static constexpr int64_t kBytes[] = {4, 2, 2, 1};
  return static_cast<char*>(cache) + layer * b->layer_stride * kBytes[b->kv_type];
}

// One layer of an int8 cache's K or V row scales (null for other caches).
float* scales_of(const Batch* b, float* scales, int64_t layer) {
  return scales ? scales + layer * b->scale_stride : nullptr;
}

// h += y, as torch's h + y rounds it.
void add_into(float* h, const float* y, int64_t count) {
  for (int64_t i = 0; i < count; ++i) h[i] = h[i] + y[i];
}

}  // namespace

extern "C" {

// h [tokens, hidden] is updated in place; scratch holds adaflash_layer_scratch_floats(...) floats.
int64_t adaflash_layer_scratch_floats(const Shape* s, int64_t tokens) {
  const int64_t qkv = (s->heads + 2 * s->kv_heads) * s->head_dim, attn = s->heads * s->head_dim;
  return tokens * (s->hidden + qkv + 2 * attn + 3 * s->intermediate);
}

void adaflash_decoder_layer(float* h, const Layer* layer, int64_t layer_index, const Shape* s, const Batch* b,
                            float* scratch, int threads) {
  const int64_t t = b->tokens, d = s->hidden, attn = s->heads * s->head_dim;
  float* x = scratch;                                           // [t, d]: a normed input, then a projection out
  float* qkv = x + t * d;                                       // [t, (H + 2 KVH) hd]
  float* q = qkv + t * (s->heads + 2 * s->kv_heads) * s->head_dim;  // [t, H hd]
  float* ctx = q + t * attn;                                    // [t, H hd]
  float* gate_up = ctx + t * attn;                              // [t, 2 I]
  float* act = gate_up + t * 2 * s->intermediate;               // [t, I]
  void* k_cache = layer_of(b, b->k_cache, layer_index);
  void* v_cache = layer_of(b, b->v_cache, layer_index);

  adaflash_rms_norm(h, t, d, layer->input_norm, s->eps, x, threads);
  run_linear(layer->qkv, x, t, qkv, threads);
  const int64_t width = (s->heads + 2 * s->kv_heads) * s->head_dim;
  for (int64_t i = 0; i < t && (layer->q_norm || layer->k_norm); ++i) {  // in place: each row is read, then written
    float* row = qkv + i * width;
    if (layer->q_norm) adaflash_rms_norm(row, s->heads, s->head_dim, layer->q_norm, s->eps, row, threads);
    float* keys = row + s->heads * s->head_dim;
    if (layer->k_norm) adaflash_rms_norm(keys, s->kv_heads, s->head_dim, layer->k_norm, s->eps, keys, threads);
  }
  float* k_scale = scales_of(b, b->k_scale, layer_index);
  float* v_scale = scales_of(b, b->v_scale, layer_index);
  adaflash_rope_qkv(qkv, t, s->heads, s->kv_heads, s->head_dim, b->cos, b->sin, k_cache, v_cache, k_scale, v_scale,
                    b->block_shift, b->table_len, b->tables, b->token_slot, b->position, q,
                    static_cast<int>(b->kv_type));
  adaflash_ragged_attention(q, s->heads, s->head_dim, k_cache, v_cache, s->kv_heads, k_scale, v_scale,
                            b->block_shift, b->table_len, b->tables, b->num_seqs,
                            b->token_start, b->seq_slot, b->key_len, s->scale, ctx, threads,
                            static_cast<int>(b->kv_type));
  run_linear(layer->o, ctx, t, x, threads);
  add_into(h, x, t * d);
  adaflash_rms_norm(h, t, d, layer->post_norm, s->eps, x, threads);
  run_linear(layer->gate_up, x, t, gate_up, threads);
  adaflash_silu_mul(gate_up, t, s->intermediate, act, threads);
  run_linear(layer->down, act, t, x, threads);
  add_into(h, x, t * d);
}

// Every layer of a stack in one call (a 1-token step of SmolLM2's 30 layers made ~10 us of ctypes and Python per
// layer, ~7% of the step): h [tokens, hidden] updated in place; captures[i], where not null, receives h after layer i,
// token r's row at captures[i] + r * capture_stride (the caller's [tokens, layers * hidden] buffer takes every
// captured layer side by side, so no tensor op runs on it after the call: one ran cold there, ~50 us a step).
void adaflash_decoder_layers(float* h, const Layer* layers, int64_t num_layers, const Shape* s, const Batch* b,
                             float* scratch, float* const* captures, int64_t capture_stride, int threads) {
  const int64_t t = b->tokens, d = s->hidden;
  for (int64_t i = 0; i < num_layers; ++i) {
    adaflash_decoder_layer(h, layers + i, i, s, b, scratch, threads);
    if (captures[i])
      for (int64_t r = 0; r < t; ++r)
        for (int64_t j = 0; j < d; ++j) captures[i][r * capture_stride + j] = h[r * d + j];
  }
}

// A target's whole forward in one call: h = embed[tokens] ([vocab, hidden] fp32 rows, copied), every layer as
// adaflash_decoder_layers, then, where head is not null, logits [num_rows, head->n] of h's rows `rows` (final RMSNorm,
// then the head's linear). The same kernels on the same values as the Python path (F.embedding, the layer stack,
// rms_norm, the head's FastLinear), so the same bits (tested). Why: after a step's weights have streamed through the
// caches, each of the ~25 torch / ctypes calls around the layer stack ran cold - ~0.9 ms a batch-1 decode step of
// SmolLM2 (4.3 ms) against ~0.25 ms warm. Returns 0; or, computing nothing, -1 where a token id is not below vocab and
// -2 where a row is not in [-t, t) (negative rows count from the end, as torch indexes). num_rows <= t.
int adaflash_decoder_forward(const int64_t* tokens, const float* embed, int64_t vocab, float* h, const Layer* layers,
                             int64_t num_layers, const Shape* s, const Batch* b, float* scratch,
                             float* const* captures, int64_t capture_stride, const float* final_norm,
                             const int64_t* rows, int64_t num_rows,
                             const Linear* head, float* logits, int threads) {
  const int64_t t = b->tokens, d = s->hidden;
  for (int64_t i = 0; i < t; ++i)
    if (tokens[i] < 0 || tokens[i] >= vocab) return -1;
  for (int64_t r = 0; head != nullptr && r < num_rows; ++r)
    if (rows[r] < -t || rows[r] >= t) return -2;
  for (int64_t i = 0; i < t; ++i)
    for (int64_t j = 0; j < d; ++j) h[i * d + j] = embed[tokens[i] * d + j];
  adaflash_decoder_layers(h, layers, num_layers, s, b, scratch, captures, capture_stride, threads);
  if (head == nullptr) return 0;
  float* selected = scratch;  // [num_rows, d]: the layers are done with their scratch
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t row = rows[r] < 0 ? rows[r] + t : rows[r];
    for (int64_t j = 0; j < d; ++j) selected[r * d + j] = h[row * d + j];
  }
  float* normed = scratch + num_rows * d;  // the scratch holds >= 2 t d floats
  adaflash_rms_norm(selected, num_rows, d, final_norm, s->eps, normed, threads);
  run_linear(*head, normed, num_rows, logits, threads);
  return 0;
}

// The DFlash drafter's context feed in one call: target features [t, n * hidden] of newly committed positions ->
// fc -> RMSNorm -> each draft layer's keys (per-head RMSNorm, RoPE) and values written into its context cache.
// The same kernels in the same order as drafters/dflash.py's Python loop, so the cache is bitwise the loop's (tested); the
// ~60 torch / ctypes calls of that loop cost ~0.4 ms a step at batch 1, ten times the arithmetic.
int64_t adaflash_context_scratch_floats(const Shape* s, int64_t tokens) {
  return tokens * (2 * s->hidden + 2 * s->kv_heads * s->head_dim);
}

void adaflash_drafter_context(const float* features, const Linear* fc, const float* hidden_norm,
                              const ContextLayer* layers, int64_t num_layers, const Shape* s, const Batch* b,
                              float* scratch, int threads) {
  const int64_t t = b->tokens, d = s->hidden, kv_width = 2 * s->kv_heads * s->head_dim;
  float* projected = scratch;        // [t, d]
  float* ctx = projected + t * d;    // [t, d]
  float* kv = ctx + t * d;           // [t, 2 KVH hd]
  run_linear(*fc, features, t, projected, threads);
  adaflash_rms_norm(projected, t, d, hidden_norm, s->eps, ctx, threads);
  for (int64_t l = 0; l < num_layers; ++l) {
    run_linear(layers[l].kv, ctx, t, kv, threads);
    for (int64_t i = 0; i < t && layers[l].k_norm; ++i)
      adaflash_rms_norm(kv + i * kv_width, s->kv_heads, s->head_dim, layers[l].k_norm, s->eps, kv + i * kv_width,
                        threads);
    adaflash_rope_qkv(kv, t, 0, s->kv_heads, s->head_dim, b->cos, b->sin, layer_of(b, b->k_cache, l),
                      layer_of(b, b->v_cache, l), scales_of(b, b->k_scale, l), scales_of(b, b->v_scale, l),
                      b->block_shift, b->table_len, b->tables, b->token_slot, b->position, nullptr,
                      static_cast<int>(b->kv_type));
  }
}

}  // extern "C"
