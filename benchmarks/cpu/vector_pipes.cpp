// Throughput of the vector operations the quantize kernels use, on this CPU: 16 independent
// chains (enough to hide every latency), one operation per chain per iteration, 512-bit and
// 256-bit; then pairs of kinds alternating across the chains, which shows the kinds that share
// execution pipes (a pair that runs no faster than one kind alone competes for the same ones).
// Nanoseconds per operation. Build and run: bash benchmarks/cpu/run.sh vector_pipes
#include <immintrin.h>

#include <chrono>
#include <cstdio>

#define FSDPN_T __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,fma"), noinline))
constexpr long kIters = 20000000;
volatile float g_sink;

template <class F>
double ns_per_op(F f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() * 1e9 / kIters / 16;
}

#define FSDPN_LOOP(V, SET1, SETI, REDUCE, OPA, OPB)                                    \
  V a[16];                                                                             \
  for (int j = 0; j < 16; ++j) a[j] = SET1(1.0f + j * 1e-7f);                          \
  const V t = SET1(1.0000001f);                                                        \
  const auto ix = SETI(3);                                                             \
  (void)ix;                                                                            \
  for (long i = 0; i < kIters; ++i) {                                                  \
    _Pragma("GCC unroll 16") for (int j = 0; j < 16; j += 2) {                         \
      a[j] = OPA(a[j]);                                                                \
      a[j + 1] = OPB(a[j + 1]);                                                        \
    }                                                                                  \
  }                                                                                    \
  float s = 0;                                                                         \
  for (int j = 0; j < 16; ++j) s += REDUCE(a[j]);                                      \
  g_sink = g_sink + s;

FSDPN_T float reduce256(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  return _mm_cvtss_f32(h);
}

// 512-bit kinds
#define FMA(x) _mm512_fmadd_ps(x, t, t)
#define ADD(x) _mm512_add_ps(x, t)
#define IADD(x) _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(x), ix))
#define SRLI(x) _mm512_castsi512_ps(_mm512_srli_epi32(_mm512_castps_si512(x), 3))
#define PERMT2PS(x) _mm512_permutex2var_ps(x, ix, t)
#define PERMPS(x) _mm512_permutexvar_ps(ix, x)
#define PERMT2B(x) _mm512_castsi512_ps(_mm512_permutex2var_epi8(_mm512_castps_si512(x), ix, _mm512_castps_si512(t)))
#define RANGE(x) _mm512_range_ps(x, t, 0x0B)
#define CMP_MASKADD(x) \
  _mm512_castsi512_ps(_mm512_mask_add_epi32(_mm512_castps_si512(x), _mm512_cmp_ps_mask(x, t, _CMP_GT_OQ), _mm512_castps_si512(x), ix))
#define Z(NAME, A, B) \
  FSDPN_T void NAME() { FSDPN_LOOP(__m512, _mm512_set1_ps, _mm512_set1_epi32, _mm512_reduce_add_ps, A, B) }
Z(z_fma, FMA, FMA) Z(z_add, ADD, ADD) Z(z_iadd, IADD, IADD) Z(z_srli, SRLI, SRLI) Z(z_permt2ps, PERMT2PS, PERMT2PS)
Z(z_permps, PERMPS, PERMPS) Z(z_permt2b, PERMT2B, PERMT2B) Z(z_range, RANGE, RANGE) Z(z_cmp_maskadd, CMP_MASKADD, CMP_MASKADD)
Z(z_fma_add, FMA, ADD) Z(z_fma_permt2ps, FMA, PERMT2PS) Z(z_fma_permps, FMA, PERMPS) Z(z_fma_permt2b, FMA, PERMT2B)
Z(z_fma_range, FMA, RANGE) Z(z_fma_srli, FMA, SRLI) Z(z_fma_iadd, FMA, IADD) Z(z_add_range, ADD, RANGE)
Z(z_add_permt2ps, ADD, PERMT2PS) Z(z_permt2ps_srli, PERMT2PS, SRLI) Z(z_permt2ps_iadd, PERMT2PS, IADD)
#undef FMA
#undef ADD
#undef PERMT2PS
#undef RANGE
// 256-bit kinds
#define FMA(x) _mm256_fmadd_ps(x, t, t)
#define ADD(x) _mm256_add_ps(x, t)
#define PERMT2PS(x) _mm256_permutex2var_ps(x, ix, t)
#define RANGE(x) _mm256_range_ps(x, t, 0x0B)
#define Y(NAME, A, B) \
  FSDPN_T void NAME() { FSDPN_LOOP(__m256, _mm256_set1_ps, _mm256_set1_epi32, reduce256, A, B) }
Y(y_fma, FMA, FMA) Y(y_add, ADD, ADD) Y(y_permt2ps, PERMT2PS, PERMT2PS) Y(y_range, RANGE, RANGE)

int main() {
  if (!__builtin_cpu_supports("avx512vbmi")) {
    std::puts("this CPU lacks AVX-512 VBMI; nothing to time");
    return 0;
  }
#define R(f) std::printf("%-18s %.3f ns/op\n", #f, ns_per_op(f));
  R(z_fma) R(z_add) R(z_iadd) R(z_srli) R(z_permt2ps) R(z_permps) R(z_permt2b) R(z_range) R(z_cmp_maskadd)
  R(y_fma) R(y_add) R(y_permt2ps) R(y_range)
  std::puts("pairs (512-bit):");
  R(z_fma_add) R(z_fma_permt2ps) R(z_fma_permps) R(z_fma_permt2b) R(z_fma_range) R(z_fma_srli) R(z_fma_iadd)
  R(z_add_range) R(z_add_permt2ps) R(z_permt2ps_srli) R(z_permt2ps_iadd)
  return 0;
}
