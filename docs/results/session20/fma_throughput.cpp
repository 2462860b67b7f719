#include <immintrin.h>
#include <x86intrin.h>
#include <cstdio>
template <class V, V (*F)(V, V, V)> double run(V a, V b) {
  V c0 = a, c1 = a, c2 = a, c3 = a, c4 = a, c5 = a, c6 = a, c7 = a, c8 = a, c9 = a, c10 = a, c11 = a;
  const long n = 100000000;
  unsigned long long t = __rdtsc();
  for (long i = 0; i < n; ++i) {
    c0 = F(c0, b, a); c1 = F(c1, b, a); c2 = F(c2, b, a); c3 = F(c3, b, a); c4 = F(c4, b, a); c5 = F(c5, b, a);
    c6 = F(c6, b, a); c7 = F(c7, b, a); c8 = F(c8, b, a); c9 = F(c9, b, a); c10 = F(c10, b, a); c11 = F(c11, b, a);
    asm volatile("" : "+x"(c0), "+x"(c1), "+x"(c2), "+x"(c3), "+x"(c4), "+x"(c5), "+x"(c6), "+x"(c7), "+x"(c8), "+x"(c9), "+x"(c10), "+x"(c11));
  }
  t = __rdtsc() - t;
  return 12.0 * n / t;  // per TSC tick
}
__m256 f256(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
__m512 f512(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
__m512i d512(__m512i a, __m512i b, __m512i c) { return _mm512_dpbusd_epi32(a, b, c); }
__m256i d256(__m256i a, __m256i b, __m256i c) { return _mm256_dpbusd_epi32(a, b, c); }
int main() {
  printf("ymm fma per tick %.2f\n", run<__m256, f256>(_mm256_set1_ps(1.0f), _mm256_set1_ps(0.999f)));
  printf("zmm fma per tick %.2f\n", run<__m512, f512>(_mm512_set1_ps(1.0f), _mm512_set1_ps(0.999f)));
  printf("ymm dpbusd per tick %.2f\n", run<__m256i, d256>(_mm256_set1_epi32(1), _mm256_set1_epi32(1)));
  printf("zmm dpbusd per tick %.2f\n", run<__m512i, d512>(_mm512_set1_epi32(1), _mm512_set1_epi32(1)));
}
