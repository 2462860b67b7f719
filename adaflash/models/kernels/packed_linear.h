// What packed_linear.cpp (the fp32 linear and its quantized / BF16 blocks, 8-lane AVX2) and packed_linear_avx512.cpp
// (its 16-lane paths) share: the packed layout's sizes and the few-rows entry point.
#pragma once
#include <cstdint>

namespace adaflash::packed {

constexpr int kPanel = 16;
// A panel's k-chunk (256 x 16 floats = 16 KB) stays in L1 while every row block uses it.
constexpr int64_t kChunk = 256;

// GGUF blocks hold 32 consecutive k of one output row. Packed per (panel, block): the 16 outputs' fp16 scales, then
// per k the 16 outputs' quants side by side.
constexpr int kBlock = 32;
enum Format { kQ4_1 = 1, kQ8_0 = 2, kBF16 = 3 };
// Q4_1: d[16], m[16] fp16, then per k 8 bytes (byte j: output j low nibble, output j + 8 high nibble).
// Q8_0: d[16] fp16, then per k 16 int8. BF16: per k the 16 outputs' bf16 side by side, no scales.
constexpr int64_t kQ4_1Packed = 64 + kBlock * 8, kQ8_0Packed = 32 + kBlock * 16, kBF16Packed = kBlock * 32;

constexpr int64_t packed_block_bytes(int format) {
  return format == kQ4_1 ? kQ4_1Packed : format == kQ8_0 ? kQ8_0Packed : kBF16Packed;
}

// A few rows (up to kFewRows) against NP panels over all of k: (x, k, panel, stride between panels, y, n, bias).
using Few = void (*)(const float*, int64_t, const void*, int64_t, float*, int64_t, const float*);
constexpr int kFewRows = 4;  // row counts up to this take the few-rows path

namespace avx512 {
// Whether the 16-lane paths run: the CPU has AVX512F/BW and no test has switched them off.
bool enabled();
extern const int kFewPanels[kFewRows + 1];  // NP per row count
// Per row count 0..kFewRows (0: null): the kernels taking kFewPanels[m] panels a call (np) or one.
const Few* few_fp32(bool np);
const Few* few_quant(int format, bool np);
// packed_linear.cpp's chunk_rows and dequant, 16 outputs a vector.
void chunk_rows(const float* x, int64_t m, int64_t k, const float* panel, int64_t k0, int64_t k1, float* y, int64_t n,
                const float* bias);
void dequant(int format, const uint8_t* panel, int64_t b0, int64_t b1, float* out);
}  // namespace avx512

}  // namespace adaflash::packed
