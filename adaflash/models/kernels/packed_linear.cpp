// y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) over fp32 weights packed once into panels of 16 outputs:
// panel p holds W[16p : 16p + 16, :] transposed, [K][16], so a k-step loads two AVX2 vectors of weights and
// broadcasts one x value per row (the outer-product micro-kernel of BLAS, up to 6 rows at a time).
//
// Why own it: stock CPU kernels make a 16-row pass cost ~2.2x a 1-row pass and stream a 1-row pass at ~60% of
// the memory bandwidth; this one streams each panel once for all rows (k-chunks stay in L1 across row blocks).
// Each output is one FMA chain over k in order, whatever the number of rows, so this kernel gives a row bitwise the
// same result in a 1-row decode step and in a 16-row verification (where the per-machine choice runs it for both).
// n must be a multiple of 16 (the Python side falls back to the stock kernel otherwise).
#include <immintrin.h>
#include <cstdint>

namespace {

constexpr int kPanel = 16;
// A panel's k-chunk (256 x 16 floats = 16 KB) stays in L1 while every row block uses it.
constexpr int64_t kChunk = 256;

// k in [k0, k1) for MR rows of one panel; partial sums wait in y between chunks (stored and reloaded exactly, so
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
    const __m256 b0 = _mm256_loadu_ps(panel + k * kPanel);
    const __m256 b1 = _mm256_loadu_ps(panel + k * kPanel + 8);
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
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t p = 0; p < n / kPanel; ++p) {
    const float* panel = packed + p * k * kPanel;
    const float* b = bias ? bias + p * kPanel : nullptr;
    for (int64_t k0 = 0; k0 < k; k0 += kChunk) {
      const int64_t k1 = k0 + kChunk < k ? k0 + kChunk : k;
      for (int64_t r0 = 0; r0 < m; r0 += 6) {
        const int mr = static_cast<int>(m - r0 < 6 ? m - r0 : 6);
        kMicro[mr](x + r0 * k, k, panel, k0, k1, y + r0 * n + p * kPanel, n, b, k0 == 0, k1 == k);
      }
    }
  }
}

}  // extern "C"
