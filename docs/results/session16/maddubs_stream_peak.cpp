#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <vector>
// Independent maddubs over streamed (L1-resident) weights, accumulated with add16: the kernel's inner pattern.
template <int K> double run(const uint8_t* buf, long bytes) {
  __m256i acc[K]; for (int i = 0; i < K; ++i) acc[i] = _mm256_setzero_si256();
  __m256i x = _mm256_set1_epi32(0x01020304);
  const long N = 20000;
  auto t0 = std::chrono::steady_clock::now();
  long count = 0;
  for (long it = 0; it < N; ++it) {
    for (long off = 0; off + 32 * K <= bytes; off += 32 * K) {
#pragma GCC unroll 16
      for (int i = 0; i < K; ++i) acc[i] = _mm256_add_epi16(acc[i], _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i*)(buf + off + 32 * i)), x));
      count += K;
    }
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  __m256i t = acc[0]; for (int i = 1; i < K; ++i) t = _mm256_add_epi16(t, acc[i]);
  volatile int r = _mm256_extract_epi16(t, 0);
  return count / s / 1e9;
}
int main() {
  std::vector<uint8_t> b(16384, 7);
  for (int rep = 0; rep < 2; ++rep) printf("load+maddubs+add: 4 acc %.2f  8 acc %.2f G/s\n", run<4>(b.data(), b.size()), run<8>(b.data(), b.size()));
}
