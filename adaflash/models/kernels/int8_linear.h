// What int8_linear.cpp (the AVX2 / AVX512-VNNI paths and the driver) and int8_amx.cpp (the AMX path for Q8_0) share:
// the packed layout's sizes, the rounded activations, the per-panel entry point, the weight stream's prefetch. The
// layout is described in int8_linear.cpp.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace adaflash::int8 {

constexpr int kPanel = 16, kBlock = 32;
enum Format { kQ4_1 = 1, kQ8_0 = 2 };  // the codes of packed_linear.cpp
constexpr int64_t kQ4_1Src = 20, kQ4_1Packed = 64 + 256, kQ8_0Src = 34, kQ8_0Packed = 32 + 512;

// A batch of rows rounded to 8 bits: q [m][k], and per (row, block) d, d * sum(q) (Q4_1's offset term), sum(q).
struct Activations {
  const int8_t* q;
  const float* d;
  const float* s;
  const int32_t* qsum;
};

// One panel for all m rows: (a, m, panel, nb, bias, y, ldy, end) - end: the end of the calling thread's share of the
// weight (a software prefetch stops there).
using PanelRows = void (*)(const Activations&, int64_t, const uint8_t*, int64_t, const float*, float*, int64_t,
                           const uint8_t*);

// Software prefetch distance in the weight stream, and the streaming itself: the hardware prefetchers do not run
// far enough ahead of a kernel that computes while it streams. The first pass over a panel's block asks for the
// lines kPrefetchAhead on (up to the end of the calling thread's share). Hint: AMD Zen 3 (AVX2) measured L1 / L2 /
// non-temporal alike, and keeps L1 (T0): 1.1x at one row, 1.2x at 4 (docs/notes.md: int8_prefetch_ab.txt);
// an AVX-512 Intel Xeon (AMX) streamed a 1-row pass 1.2-1.3x faster into L2 (T1) than without (L1 at 8 KB
// measured as none: its ~16 line-fill buffers cannot hold 128 lines in flight; docs/notes.md).
constexpr int64_t kPrefetchAhead = 8192;

template <_mm_hint Hint>
inline void prefetch_ahead(const uint8_t* blk, int64_t bytes, const uint8_t* end) {
  if (blk + kPrefetchAhead < end)
    for (int64_t c = 0; c < bytes; c += 64) _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchAhead + c), Hint);
}

// Rows of activation padding the scratch keeps after the last row: the AMX path loads whole 16-row tiles.
constexpr int64_t kPadRows = 16;

namespace amx {
// Whether the CPU has AMX-INT8 and Linux let this process use its tile registers (asked once).
bool available();
// Each thread that runs amx::kQ8_0Rows loads the tile configuration first (other libraries, oneDNN among them,
// load their own on the same threads) and releases the tiles after.
void begin();
void end();
extern const PanelRows kQ8_0Rows;  // Q8_0 only (see int8_amx.cpp)
}  // namespace amx

}  // namespace adaflash::int8

// kquant.cpp: Q5_0, Q4_K, Q5_K, Q6_K (format codes 4-7) for the int8 kernel and the fp32 one's dequantization.
namespace adaflash::kquant {
bool handles(int format);
int64_t block_bytes(int format);  // one packed (panel, block of 32), averaged over a super-block
adaflash::int8::PanelRows panel_rows(int format);
void dequant(int format, const uint8_t* panel, int64_t b0, int64_t b1, float* out);
}  // namespace adaflash::kquant
