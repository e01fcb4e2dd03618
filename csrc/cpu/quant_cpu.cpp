// CPU kernels of the quantized all-gather ops: one call per unit, multithreaded over tasks
// of about kTaskElems elements (whole rows for fp8_rowwise, whole blocks for NF4), the
// element loops compiled once per ISA (AVX-512, AVX2, baseline) and picked at load time.
// The element math is quant_math.h's, the same the Triton kernels and the Python reference
// restate, so all three write the same bytes.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../quant.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define FSDPN_QUANT_X86 1
#else
#define FSDPN_QUANT_X86 0
#endif

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define FSDPN_MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define FSDPN_MULTIVERSION
#endif
// One rounding per operation in every clone (the reference and Triton round each op).
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif
#if defined(__GNUC__)
#define FSDPN_INLINE inline __attribute__((always_inline))
#else
#define FSDPN_INLINE inline
#endif

namespace fsdp_native {
namespace quant {
namespace {

// Elements per task: large enough to amortise the task, small enough to balance threads.
constexpr int64_t kTaskElems = int64_t{1} << 15;
// Below this many elements a call runs on the calling thread: waking the pool costs more
// than the work (the overhead model's units).
constexpr int64_t kParallelMinElems = int64_t{1} << 17;

template <typename S>
FSDPN_INLINE uint32_t bits_of(S v) { return float_bits(to_float(v)); }

// --- element loops (inlined into each ISA clone below) ---------------------------------------

template <typename S>
FSDPN_INLINE uint32_t max_finite_abs_loop(const S* __restrict src, int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, finite_abs_bits(bits_of(src[i])));
  return m;
}

template <typename S>
FSDPN_INLINE uint32_t max_abs_loop(const S* __restrict src, int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, bits_of(src[i]) & 0x7fffffffu);
  return m;
}

template <typename S>
FSDPN_INLINE void fp8_encode_loop(const S* __restrict src, int64_t n, float inv_scale,
                                  uint8_t* __restrict dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = fp8_encode(to_float(src[i]), inv_scale);
}

FSDPN_INLINE uint8_t nf4_pair(float a, float b, float inv_scale) {
  return static_cast<uint8_t>((nf4_code(a * inv_scale) << 4) | nf4_code(b * inv_scale));
}

// NF4 blocks: `src` holds `n` elements (the rest of the padded range reads as 0), the
// padded range has `len` elements from the first block on; writes the codes of blocks
// [0, n_blocks) at `codes` and their scales at `scales` (unaligned-safe copies).
template <typename S>
FSDPN_INLINE void nf4_blocks_loop(const S* __restrict src, int64_t n, int64_t len,
                                  int64_t n_blocks, int64_t block, uint8_t* __restrict codes,
                                  uint8_t* __restrict scales) {
  for (int64_t b = 0; b < n_blocks; ++b) {
    const int64_t lo = b * block;
    const int64_t blen = std::min(block, len - lo);
    const int64_t valid = std::max<int64_t>(0, std::min(blen, n - lo));
    const S* s = src + lo;
    uint8_t* c = codes + lo / 2;
    const float scale = nf4_scale(max_abs_loop(s, valid));
    std::memcpy(scales + 4 * b, &scale, 4);
    const float inv = 1.0f / scale;
    if (valid == block) {  // full block: no bounds checks, vectorises
      for (int64_t k = 0; k < block / 2; ++k) {
        c[k] = nf4_pair(to_float(s[2 * k]), to_float(s[2 * k + 1]), inv);
      }
      continue;
    }
    for (int64_t k = 0; k < (blen + 1) / 2; ++k) {
      const float a = 2 * k < valid ? to_float(s[2 * k]) : 0.0f;
      const float v = 2 * k + 1 < valid ? to_float(s[2 * k + 1]) : 0.0f;
      c[k] = nf4_pair(a, v, inv);
    }
  }
}

template <typename D>
FSDPN_INLINE void fp8_decode_loop(const uint8_t* __restrict codes, int64_t n, float scale,
                                  D* __restrict dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = store_value<D>(e4m3_to_float(codes[i]) * scale);
}

// NF4 elements [lo, hi) of a segment (lo a multiple of the block, hence even).
template <typename D>
FSDPN_INLINE void nf4_decode_loop(const uint8_t* __restrict codes, const uint8_t* scales,
                                  int64_t lo, int64_t hi, int64_t block, D* __restrict dst) {
  for (int64_t b0 = lo; b0 < hi; b0 += block) {
    float scale;
    std::memcpy(&scale, scales + 4 * (b0 / block), 4);
    const int64_t end = std::min(hi, b0 + block);
    const int64_t pairs = (end - b0) / 2;
    const uint8_t* c = codes + b0 / 2;
    D* d = dst + (b0 - lo);
    for (int64_t k = 0; k < pairs; ++k) {
      const uint32_t byte = c[k];
      d[2 * k] = store_value<D>(nf4_value(byte >> 4) * scale);
      d[2 * k + 1] = store_value<D>(nf4_value(byte & 15u) * scale);
    }
    if ((end - b0) & 1) d[end - b0 - 1] = store_value<D>(nf4_value(c[pairs] >> 4) * scale);
  }
}

#if FSDPN_QUANT_X86
// fp8 with AVX-512, 16 elements at a time: the same bit manipulation as fp8_encode /
// e4m3_to_float / store_value (quant_math.h), written out because GCC's vectorisation of
// those loops runs 1.7x slower (mask registers moved through general registers).
template <typename S>
__attribute__((target("avx512f,avx512bw"))) inline __m512i load16_bits(const S* p) {
  if constexpr (std::is_same<S, float>::value) {
    return _mm512_loadu_si512(p);
  } else {
    return _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  }
}

template <typename D>
__attribute__((target("avx512f,avx512bw"))) inline void store16(D* p, __m512 v, __mmask16 nan) {
  if constexpr (std::is_same<D, float>::value) {
    _mm512_storeu_ps(p, _mm512_mask_mov_ps(v, nan, _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(kNaNBits)))));
  } else {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
}

template <typename S>
__attribute__((target("avx512f,avx512bw"))) void fp8_encode_avx512(const void* src, int64_t n, float inv_scale, uint8_t* d) {
  const S* s = static_cast<const S*>(src);
  const __m512 inv = _mm512_set1_ps(inv_scale);
  const __m512i absm = _mm512_set1_epi32(0x7fffffff);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i xb = load16_bits(s + i);
    const __mmask16 finite = _mm512_cmplt_epi32_mask(_mm512_and_si512(xb, absm), _mm512_set1_epi32(0x7f800000));
    const __m512 q = _mm512_mul_ps(_mm512_castsi512_ps(xb), inv);
    const __m512 c = _mm512_min_ps(_mm512_max_ps(q, _mm512_set1_ps(-kE4M3Max)), _mm512_set1_ps(kE4M3Max));
    const __m512i u = _mm512_castps_si512(c);
    const __m512i a = _mm512_and_si512(u, absm);
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1));
    const __m512i normal = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32(0x7ffff - (120 << 23))), odd), 20);
    const __m512i sub = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(16384.0f))),
                                         _mm512_set1_epi32(141 << 23));
    __m512i code = _mm512_or_si512(_mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(a, _mm512_set1_epi32(0x3c800000)), normal, sub), sign);
    code = _mm512_mask_blend_epi32(finite, _mm512_set1_epi32(kE4M3NaN), code);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), _mm512_cvtepi32_epi8(code));
  }
  for (; i < n; ++i) d[i] = fp8_encode(to_float(s[i]), inv_scale);
}

template <typename D>
__attribute__((target("avx512f,avx512bw"))) void fp8_decode_avx512(const uint8_t* c, int64_t n, float scale, void* dst) {
  D* d = static_cast<D*>(dst);
  const __m512 sc = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + i)));
    const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7f));
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
    // (e << 23 | m << 20) rebiased; below 8 (exponent 0) the subnormal m * 2^-9
    __m512i bits = _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23));
    const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(0x1p-9f));
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8)), _mm512_castps_si512(sub));
    const __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(bits, sign)), sc);
    const __mmask16 nan = _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7f)) | _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    store16(d + i, v, nan);
  }
  for (; i < n; ++i) d[i] = store_value<D>(e4m3_to_float(c[i]) * scale);
}

// NF4 encoding with AVX-512 for whole blocks of 32 or more elements: the code is found by a
// binary search over the 15 midpoints held in one register (4 vpermps + compares instead of
// 15 compares), with the midpoint rule of nf4_code (a tie takes the lower code; NaN: 0).
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512i nf4_codes16(__m512 v, __m512 mids) {
  __m512i c = _mm512_setzero_si512();
  for (int step = 8; step >= 1; step /= 2) {
    const __m512 thr = _mm512_permutexvar_ps(_mm512_add_epi32(c, _mm512_set1_epi32(step - 1)), mids);
    c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(v, thr, _CMP_GT_OQ), c, _mm512_set1_epi32(step));
  }
  return c;
}

template <typename S>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void nf4_blocks_avx512(
    const void* src, int64_t n, int64_t len, int64_t n_blocks, int64_t block, uint8_t* codes, uint8_t* scales) {
  const S* s = static_cast<const S*>(src);
  alignas(64) float m[16];
  for (int k = 0; k < 15; ++k) m[k] = 0.0f;
  {  // the midpoints are the thresholds where nf4_code steps up
    const float t[15] = {-0x1.b239bp-1f, -0x1.38a4ep-1f, -0x1.d709p-2f, -0x1.5bd4ecp-2f, -0x1.e079d8p-3f,
                         -0x1.1a7178p-3f, -0x1.74f0e2p-5f, 0x1.45f5fep-5f, 0x1.ec90c4p-4f, 0x1.a0cfcp-3f,
                         0x1.2b05a8p-2f, 0x1.8ea7f2p-2f, 0x1.00da08p-1f, 0x1.491b5ep-1f, 0x1.b913b4p-1f};
    for (int k = 0; k < 15; ++k) m[k] = t[k];
    m[15] = 3.0e38f;  // never indexed
  }
  const __m512 mids = _mm512_load_ps(m);
  const __m512i absm = _mm512_set1_epi32(0x7fffffff);
  for (int64_t b = 0; b < n_blocks; ++b) {
    const int64_t lo = b * block;
    const int64_t valid = std::max<int64_t>(0, std::min(std::min(block, len - lo), n - lo));
    if (block < 32 || valid != block) {
      nf4_blocks_loop(s + lo, n - lo, len - lo, 1, block, codes + lo / 2, scales + 4 * b);
      continue;
    }
    __m512i mx = _mm512_setzero_si512();
    for (int64_t k = 0; k < block; k += 16) mx = _mm512_max_epu32(mx, _mm512_and_si512(load16_bits(s + lo + k), absm));
    const float scale = nf4_scale(_mm512_reduce_max_epu32(mx));
    std::memcpy(scales + 4 * b, &scale, 4);
    const __m512 inv = _mm512_set1_ps(1.0f / scale);
    for (int64_t k = 0; k < block; k += 32) {
      const __m512i c0 = nf4_codes16(_mm512_mul_ps(_mm512_castsi512_ps(load16_bits(s + lo + k)), inv), mids);
      const __m512i c1 = nf4_codes16(_mm512_mul_ps(_mm512_castsi512_ps(load16_bits(s + lo + k + 16)), inv), mids);
      const __m256i bytes = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm512_cvtepi32_epi8(c0)), _mm512_cvtepi32_epi8(c1), 1);
      const __m256i pairs = _mm256_or_si256(_mm256_slli_epi16(bytes, 4), _mm256_srli_epi16(bytes, 8));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + (lo + k) / 2), _mm256_cvtepi16_epi8(pairs));
    }
  }
}

// NF4 decoding with AVX-512: 32 codes at a time, the 16-entry table in one register
// (vpermps), the bf16 rounding as quant_math.h's store_value. GCC does not vectorise the
// table lookup on its own (it finds no gather for a nibble index).
__attribute__((target("avx512f,avx512bw"))) void nf4_expand32(const uint8_t* c, __m512 table,
                                                              __m512 scale, __m512* v) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
  const __m128i low4 = _mm_set1_epi8(15);
  const __m128i h = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
  const __m128i l = _mm_and_si128(b, low4);
  v[0] = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(h, l)), table), scale);
  v[1] = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(h, l)), table), scale);
}

template <typename D>
__attribute__((target("avx512f,avx512bw"))) void nf4_decode_avx512(const uint8_t* codes,
                                                                   const uint8_t* scales,
                                                                   int64_t lo, int64_t hi,
                                                                   int64_t block, D* dst) {
  alignas(64) float t[16];
  for (uint32_t k = 0; k < 16; ++k) t[k] = nf4_value(k);
  const __m512 table = _mm512_load_ps(t);
  for (int64_t b0 = lo; b0 < hi; b0 += block) {
    float s;
    std::memcpy(&s, scales + 4 * (b0 / block), 4);
    const __m512 scale = _mm512_set1_ps(s);
    const int64_t n = std::min(hi, b0 + block) - b0;
    const uint8_t* c = codes + b0 / 2;
    D* d = dst + (b0 - lo);
    int64_t k = 0;
    for (; k + 32 <= n; k += 32) {
      __m512 v[2];
      nf4_expand32(c + k / 2, table, scale, v);
      for (int j = 0; j < 2; ++j) store16(d + k + 16 * j, v[j], _mm512_cmp_ps_mask(v[j], v[j], _CMP_UNORD_Q));
    }
    for (; k < n; ++k) {
      const uint32_t byte = c[k / 2];
      d[k] = store_value<D>(nf4_value((k & 1) ? (byte & 15u) : (byte >> 4)) * s);
    }
  }
}

bool have_avx512() {
  static const bool v = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
  }();
  return v;
}
#endif

// --- one multiversioned entry point per dtype ----------------------------------------------------

struct SrcFns {
  uint32_t (*max_finite_abs)(const void*, int64_t);
  void (*fp8_encode)(const void*, int64_t, float, uint8_t*);
  void (*nf4_blocks)(const void*, int64_t, int64_t, int64_t, int64_t, uint8_t*, uint8_t*);
};
struct DstFns {
  void (*fp8_decode)(const uint8_t*, int64_t, float, void*);
  void (*nf4_decode)(const uint8_t*, const uint8_t*, int64_t, int64_t, int64_t, void*);
};

#define FSDPN_DEFINE(T)                                                                         \
  FSDPN_MULTIVERSION uint32_t max_finite_abs_##T(const void* s, int64_t n) {                    \
    return max_finite_abs_loop(static_cast<const T*>(s), n);                                    \
  }                                                                                             \
  FSDPN_MULTIVERSION void fp8_encode_##T(const void* s, int64_t n, float k, uint8_t* d) {       \
    fp8_encode_loop(static_cast<const T*>(s), n, k, d);                                         \
  }                                                                                             \
  FSDPN_MULTIVERSION void nf4_blocks_##T(const void* s, int64_t n, int64_t len, int64_t nb,     \
                                         int64_t block, uint8_t* c, uint8_t* sc) {              \
    nf4_blocks_loop(static_cast<const T*>(s), n, len, nb, block, c, sc);                        \
  }                                                                                             \
  FSDPN_MULTIVERSION void fp8_decode_##T(const uint8_t* c, int64_t n, float k, void* d) {       \
    fp8_decode_loop(c, n, k, static_cast<T*>(d));                                               \
  }                                                                                             \
  FSDPN_MULTIVERSION void nf4_decode_##T(const uint8_t* c, const uint8_t* sc, int64_t lo,       \
                                         int64_t hi, int64_t block, void* d) {                  \
    nf4_decode_loop(c, sc, lo, hi, block, static_cast<T*>(d));                                  \
  }
FSDPN_DEFINE(float)
FSDPN_DEFINE(bf16_t)
FSDPN_DEFINE(f16_t)
#undef FSDPN_DEFINE

#if FSDPN_QUANT_X86
void nf4_decode_avx512_float(const uint8_t* c, const uint8_t* sc, int64_t lo, int64_t hi, int64_t block, void* d) {
  nf4_decode_avx512(c, sc, lo, hi, block, static_cast<float*>(d));
}
void nf4_decode_avx512_bf16(const uint8_t* c, const uint8_t* sc, int64_t lo, int64_t hi, int64_t block, void* d) {
  nf4_decode_avx512(c, sc, lo, hi, block, static_cast<bf16_t*>(d));
}
#endif

SrcFns src_fns(at::ScalarType t) {
  switch (t) {
#if FSDPN_QUANT_X86
    case at::kFloat:
      if (have_avx512()) return {max_finite_abs_float, fp8_encode_avx512<float>, nf4_blocks_avx512<float>};
      return {max_finite_abs_float, fp8_encode_float, nf4_blocks_float};
    case at::kBFloat16:
      if (have_avx512()) return {max_finite_abs_bf16_t, fp8_encode_avx512<bf16_t>, nf4_blocks_avx512<bf16_t>};
      return {max_finite_abs_bf16_t, fp8_encode_bf16_t, nf4_blocks_bf16_t};
#else
    case at::kFloat: return {max_finite_abs_float, fp8_encode_float, nf4_blocks_float};
    case at::kBFloat16: return {max_finite_abs_bf16_t, fp8_encode_bf16_t, nf4_blocks_bf16_t};
#endif
    default: return {max_finite_abs_f16_t, fp8_encode_f16_t, nf4_blocks_f16_t};
  }
}
DstFns dst_fns(at::ScalarType t) {
  switch (t) {
#if FSDPN_QUANT_X86
    case at::kFloat:
      if (have_avx512()) return {fp8_decode_avx512<float>, nf4_decode_avx512_float};
      return {fp8_decode_float, nf4_decode_float};
    case at::kBFloat16:
      if (have_avx512()) return {fp8_decode_avx512<bf16_t>, nf4_decode_avx512_bf16};
      return {fp8_decode_bf16_t, nf4_decode_bf16_t};
#else
    case at::kFloat: return {fp8_decode_float, nf4_decode_float};
    case at::kBFloat16: return {fp8_decode_bf16_t, nf4_decode_bf16_t};
#endif
    default: return {fp8_decode_f16_t, nf4_decode_f16_t};
  }
}

// --- tasks -------------------------------------------------------------------------------

// Elements [lo, hi) of parameter `param` (of rank `rank`'s chunk, for dequantize).
struct Task {
  int64_t param, rank, lo, hi;
};

// Cuts [0, len) into tasks of whole units (`unit` elements: a row, a block) of about
// kTaskElems elements each.
void add_tasks(std::vector<Task>& tasks, int64_t param, int64_t rank, int64_t len, int64_t unit) {
  const int64_t step = std::max<int64_t>(1, kTaskElems / std::max<int64_t>(unit, 1)) * std::max<int64_t>(unit, 1);
  for (int64_t lo = 0; lo < len; lo += step) tasks.push_back({param, rank, lo, std::min(len, lo + step)});
}

int64_t task_unit(int fmt, const QuantParam& p, int64_t block) {
  if (fmt == kNf4) return block;
  if (fmt == kFp8Rowwise) return p.row_numel;
  return 64;
}

template <typename F>
void run_tasks(const std::vector<Task>& tasks, F f) {
  int64_t elems = 0;
  for (const Task& k : tasks) elems += k.hi - k.lo;
  if (elems < kParallelMinElems) {
    for (const Task& k : tasks) f(k);
    return;
  }
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) f(tasks[t]);
  });
}

const char* elem_ptr(const QuantParam& p, int64_t i) {
  return static_cast<const char*>(p.data) + i * static_cast<int64_t>(c10::elementSize(p.dtype));
}

// amax over the finite values of each parameter, as float bits, in one parallel pass.
std::vector<float> finite_amax(const std::vector<QuantParam>& params) {
  std::vector<Task> tasks;
  for (size_t i = 0; i < params.size(); ++i) add_tasks(tasks, i, 0, params[i].numel, 64);
  std::vector<uint32_t> partial(tasks.size(), 0);
  const Task* first = tasks.data();
  run_tasks(tasks, [&](const Task& k) {
    const QuantParam& p = params[k.param];
    partial[&k - first] = src_fns(p.dtype).max_finite_abs(elem_ptr(p, k.lo), k.hi - k.lo);
  });
  std::vector<uint32_t> bits(params.size(), 0);
  for (size_t t = 0; t < tasks.size(); ++t) bits[tasks[t].param] = std::max(bits[tasks[t].param], partial[t]);
  std::vector<float> out(params.size());
  for (size_t i = 0; i < params.size(); ++i) out[i] = bits_float(bits[i]);
  return out;
}

void zero_gaps(uint8_t* seg, const SegmentLayout& l) {
  std::memset(seg + l.data_nbytes, 0, static_cast<size_t>(l.scale_offset - l.data_nbytes));
  const int64_t scales_end = l.scale_offset + 4 * l.n_scales;
  std::memset(seg + scales_end, 0, static_cast<size_t>(l.nbytes - scales_end));
}

void quantize_task(const QuantizePlan& plan, const Task& k) {
  const QuantParam& p = plan.params[k.param];
  uint8_t* seg = plan.out + p.offset;
  uint8_t* scales = seg + p.layout.scale_offset;
  const SrcFns fns = src_fns(p.dtype);
  if (plan.fmt == kNf4) {
    const int64_t n_blocks = (k.hi - k.lo + plan.block - 1) / plan.block;
    fns.nf4_blocks(elem_ptr(p, k.lo), p.numel - k.lo, k.hi - k.lo, n_blocks, plan.block,
                   seg + k.lo / 2, scales + 4 * (k.lo / plan.block));
    return;
  }
  auto encode = [&](int64_t lo, int64_t hi, float scale) {
    const int64_t valid_hi = std::min(hi, p.numel);
    if (valid_hi > lo) fns.fp8_encode(elem_ptr(p, lo), valid_hi - lo, 1.0f / scale, seg + lo);
    const int64_t z = std::max(lo, valid_hi);
    if (hi > z) std::memset(seg + z, 0, static_cast<size_t>(hi - z));  // 0x00 encodes +0
  };
  if (plan.fmt == kFp8Tensorwise) {
    float scale;
    std::memcpy(&scale, scales, 4);
    encode(k.lo, k.hi, scale);
    return;
  }
  const int64_t row = p.row_numel;
  for (int64_t r0 = k.lo; r0 < k.hi; r0 += row) {
    const int64_t valid = std::max<int64_t>(0, std::min(row, p.numel - r0));
    const float scale = fp8_scale(bits_float(valid > 0 ? fns.max_finite_abs(elem_ptr(p, r0), valid) : 0u));
    std::memcpy(scales + 4 * (r0 / row), &scale, 4);
    encode(r0, r0 + row, scale);
  }
}

void quantize_copy_in_cpu(at::TensorList shards, at::IntArrayRef padded_numels,
                          at::IntArrayRef row_numels, c10::string_view format, int64_t block_size,
                          const c10::optional<at::Tensor>& amax, const at::Tensor& out) {
  const QuantizePlan plan =
      plan_quantize_copy_in(shards, padded_numels, row_numels, format, block_size, amax, out);
  if (plan.fmt == kFp8Tensorwise) {
    std::vector<float> a;
    if (plan.amax != nullptr) a.assign(plan.amax, plan.amax + plan.params.size());
    else a = finite_amax(plan.params);
    for (size_t i = 0; i < plan.params.size(); ++i) {
      const QuantParam& p = plan.params[i];
      if (p.layout.n_scales == 0) continue;
      const float scale = fp8_scale(a[i]);
      std::memcpy(plan.out + p.offset + p.layout.scale_offset, &scale, 4);
    }
  }
  std::vector<Task> tasks;
  for (size_t i = 0; i < plan.params.size(); ++i) {
    const QuantParam& p = plan.params[i];
    if (p.layout.nbytes == 0) continue;
    zero_gaps(plan.out + p.offset, p.layout);
    add_tasks(tasks, i, 0, p.padded, task_unit(plan.fmt, p, plan.block));
  }
  run_tasks(tasks, [&](const Task& k) { quantize_task(plan, k); });
}

// Dequantized elements [a, b) of a rank's segment into `dst` (a: a multiple of the NF4 block).
void decode_range(const DequantizePlan& plan, const QuantParam& p, const DstFns& fns,
                  const uint8_t* seg, int64_t a, int64_t b, char* dst) {
  const uint8_t* scales = seg + p.layout.scale_offset;
  if (plan.fmt == kNf4) {
    fns.nf4_decode(seg, scales, a, b, plan.block, dst);
    return;
  }
  const int64_t es = static_cast<int64_t>(c10::elementSize(p.dtype));
  const bool rowwise = plan.fmt == kFp8Rowwise;
  for (int64_t r0 = a; r0 < b;) {
    const int64_t end = rowwise ? std::min(b, (r0 / p.row_numel + 1) * p.row_numel) : b;
    float scale;
    std::memcpy(&scale, scales + 4 * (rowwise ? r0 / p.row_numel : 0), 4);
    fns.fp8_decode(seg + r0, end - r0, scale, dst + (r0 - a) * es);
    r0 = end;
  }
}

void dequantize_task(const DequantizePlan& plan, const Task& k) {
  const QuantParam& p = plan.params[k.param];
  const uint8_t* seg = plan.gathered + k.rank * plan.rank_stride + p.offset;
  const int64_t es = static_cast<int64_t>(c10::elementSize(p.dtype));
  decode_range(plan, p, dst_fns(p.dtype), seg, k.lo, k.hi,
               static_cast<char*>(p.data) + (k.rank * p.padded + k.lo) * es);
}

void dequantize_copy_out_cpu(const at::Tensor& gathered, at::IntArrayRef padded_numels,
                             at::IntArrayRef row_numels, int64_t world_size,
                             c10::string_view format, int64_t block_size, at::TensorList outs) {
  const DequantizePlan plan = plan_dequantize_copy_out(gathered, padded_numels, row_numels,
                                                       world_size, format, block_size, outs);
  std::vector<Task> tasks;
  for (size_t i = 0; i < plan.params.size(); ++i) {
    const QuantParam& p = plan.params[i];
    for (int64_t r = 0; r < plan.world_size; ++r) {
      const int64_t valid = shard_valid_numel(p.numel, p.padded, r);
      if (valid == 0) break;
      add_tasks(tasks, i, r, valid, task_unit(plan.fmt, p, plan.block));
    }
  }
  run_tasks(tasks, [&](const Task& k) { dequantize_task(plan, k); });
}

void quantize_amax_cpu(at::TensorList shards, const at::Tensor& out) {
  const AmaxPlan plan = plan_quantize_amax(shards, out);
  const std::vector<float> a = finite_amax(plan.params);
  std::copy(a.begin(), a.end(), plan.out);
}

}  // namespace

TORCH_LIBRARY_IMPL(fsdp_native, CPU, m) {
  m.impl("quantize_copy_in", &quantize_copy_in_cpu);
  m.impl("dequantize_copy_out", &dequantize_copy_out_cpu);
  m.impl("quantize_amax", &quantize_amax_cpu);
}

}  // namespace quant
}  // namespace fsdp_native
