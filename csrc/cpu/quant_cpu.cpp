// CPU kernels of the quantized all-gather ops: one call per unit, multithreaded over tasks
// of about kTaskElems elements (whole rows for fp8_rowwise, whole blocks for NF4), the
// element loops compiled once per ISA (AVX-512, AVX2, baseline) and picked at load time.
// The element math is quant_math.h's, the same the Triton kernels and the Python reference
// restate, so all three write the same bytes.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <cctype>
#include <string>
#include <vector>

#include "../quant.h"

#if defined(__x86_64__) && defined(__GNUC__)
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ == 12
// GCC 12's AVX-512 headers warn on their own _mm512_undefined_* temporaries (GCC bug 105593).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>
#define FSDPN_QUANT_X86 1
#else
#define FSDPN_QUANT_X86 0
#endif

#include "clones.h"

namespace fsdp_native {
namespace quant {
namespace {

// FSDP_NATIVE_QUANT_ISA caps the kernels: "auto" (default: the best the CPU has), "avx512" (the
// AVX-512 F/BW/VL kernels, not the VBMI/BF16 ones), "avx2" (the AVX2 kernels) or "portable"
// (the compiled loops only), so
// the tests can check every level on one machine. Read once (case and surrounding spaces
// ignored, as fsdp_native's Python switches); a bad value fails every op that would use it.
int isa_cap() {
  static const int v = [] {
    const char* e = std::getenv("FSDP_NATIVE_QUANT_ISA");
    std::string s = e == nullptr ? "" : e;
    const auto b = s.find_first_not_of(" \t"), t = s.find_last_not_of(" \t");
    s = b == std::string::npos ? "" : s.substr(b, t - b + 1);
    for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (s.empty() || s == "auto") return 3;
    if (s == "avx512") return 2;
    if (s == "avx2") return 1;
    if (s == "portable") return 0;
    return -1;
  }();
  TORCH_CHECK(v >= 0, "fsdp_native: environment variable FSDP_NATIVE_QUANT_ISA must be one of auto, avx512, avx2, portable, got '",
              std::getenv("FSDP_NATIVE_QUANT_ISA"), "'");
  return v;
}

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

// nf4_value as a table in memory: GCC vectorises loads from it (gathers), not the lookup into
// nf4_value's own local array (the AVX2 and baseline clones of the decode ran scalar).
struct Nf4Table {
  float v[16];
  Nf4Table() {
    for (uint32_t k = 0; k < 16; ++k) v[k] = nf4_value(k);
  }
};
alignas(64) const Nf4Table kNf4Table;

// NF4 elements [lo, hi) of a segment (lo a multiple of the block, hence even).
template <typename D>
FSDPN_INLINE void nf4_decode_loop(const uint8_t* __restrict codes, const uint8_t* scales,
                                  int64_t lo, int64_t hi, int64_t block, D* __restrict dst) {
  const float* t = kNf4Table.v;
  for (int64_t b0 = lo; b0 < hi; b0 += block) {
    float scale;
    std::memcpy(&scale, scales + 4 * (b0 / block), 4);
    const int64_t end = std::min(hi, b0 + block);
    const int64_t pairs = (end - b0) / 2;
    const uint8_t* c = codes + b0 / 2;
    D* d = dst + (b0 - lo);
    for (int64_t k = 0; k < pairs; ++k) {
      const uint32_t byte = c[k];
      d[2 * k] = store_value<D>(t[byte >> 4] * scale);
      d[2 * k + 1] = store_value<D>(t[byte & 15u] * scale);
    }
    if ((end - b0) & 1) d[end - b0 - 1] = store_value<D>(t[c[pairs] >> 4] * scale);
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
  return v && isa_cap() >= 2;
}

bool have_avx2() {
  static const bool v = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return v && isa_cap() >= 1;
}

// AVX2 and F16C (the fp8 decode), AVX2 and FMA (the NF4 encode).
enum Avx2With { kF16c, kFma };
bool have_avx2_with(Avx2With f) {
  static const bool v[2] = {(__builtin_cpu_init(), __builtin_cpu_supports("f16c") != 0), __builtin_cpu_supports("fma") != 0};
  return v[f] && have_avx2();
}

// --- AVX2 (CPUs without AVX-512: Zen 2/3, Haswell to Comet Lake) -------------------------------
//
// NF4 decode into bf16 with byte shuffles: per block, the 16 values store_value(t[k] * scale)
// (the same bits the loop computes per element) as two 16-entry byte tables (low and high
// bytes), then 32 code bytes (64 elements) per step: nibbles split and put in element order,
// each looked up in both tables by VPSHUFB, the bytes joined into bf16. Blocks that are not
// whole multiples of 64 elements take the loop.
#define FSDPN_AVX2 __attribute__((target("avx2")))

// store_value<bf16_t>'s bits for 8 non-NaN floats (given as bits), in the low halves of 32-bit
// lanes: nearest even.
FSDPN_AVX2 FSDPN_INLINE __m256i bf16_round_hi_avx2(__m256i x) {  // the bits in the high halves
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), odd);
}
FSDPN_AVX2 FSDPN_INLINE __m256i bf16_bits8_finite_avx2(__m256i x) { return _mm256_srli_epi32(bf16_round_hi_avx2(x), 16); }

// The same for any 8 floats: NaN stores 0x7fc0.
FSDPN_AVX2 FSDPN_INLINE __m256i bf16_bits8_avx2(__m256i x) {
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  return _mm256_blendv_epi8(bf16_bits8_finite_avx2(x), _mm256_set1_epi32(0x7fc0), nan);
}

// The bf16 bits of store_value<bf16_t>(t[k] * scale), k = 0..15, as (low bytes, high bytes),
// each 16-entry table in both 128-bit lanes.
FSDPN_AVX2 FSDPN_INLINE void nf4_bf16_tables(float scale, __m256i& lo, __m256i& hi) {
  const __m256 s = _mm256_set1_ps(scale);
  __m256i u[2];
  for (int h = 0; h < 2; ++h) {
    u[h] = bf16_bits8_avx2(_mm256_castps_si256(_mm256_mul_ps(_mm256_loadu_ps(kNf4Table.v + 8 * h), s)));
  }
  // 16 x u16 in order: packus is per 128-bit lane, so fix the quadword order after it.
  const __m256i w = _mm256_permute4x64_epi64(_mm256_packus_epi32(u[0], u[1]), 0xd8);
  // Per lane: the 8 low bytes, then the 8 high bytes; then [lo 0-7, lo 8-15, hi 0-7, hi 8-15].
  const __m256i split = _mm256_shuffle_epi8(
      w, _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
  const __m256i q = _mm256_permute4x64_epi64(split, 0xd8);
  lo = _mm256_permute2x128_si256(q, q, 0x00);
  hi = _mm256_permute2x128_si256(q, q, 0x11);
}

FSDPN_AVX2 void nf4_decode_avx2_bf16(const uint8_t* codes, const uint8_t* scales, int64_t lo, int64_t hi,
                                     int64_t block, void* dst) {
  bf16_t* out = static_cast<bf16_t*>(dst);
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  int64_t b0 = lo;
  for (; b0 < hi; b0 += block) {
    if (block % 64 != 0 || b0 + block > hi) break;  // the loop takes the rest
    float scale;
    std::memcpy(&scale, scales + 4 * (b0 / block), 4);
    __m256i tlo, thi;
    nf4_bf16_tables(scale, tlo, thi);
    const uint8_t* c = codes + b0 / 2;
    bf16_t* d = out + (b0 - lo);
    for (int64_t k = 0; k < block; k += 64) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + k / 2));
      const __m256i first = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);  // high nibbles: even elements
      const __m256i second = _mm256_and_si256(b, low4);
      // Per lane, bytes 0-7 (e0) and 8-15 (e1) of the codes, as 16 element indices each.
      const __m256i e0 = _mm256_unpacklo_epi8(first, second), e1 = _mm256_unpackhi_epi8(first, second);
      const __m256i l0 = _mm256_shuffle_epi8(tlo, e0), h0 = _mm256_shuffle_epi8(thi, e0);
      const __m256i l1 = _mm256_shuffle_epi8(tlo, e1), h1 = _mm256_shuffle_epi8(thi, e1);
      // v0: lane 0 elements 0-7 | lane 1 elements 32-39; w0: 8-15 | 40-47; v1: 16-23 | 48-55; w1: 24-31 | 56-63.
      const __m256i v0 = _mm256_unpacklo_epi8(l0, h0), w0 = _mm256_unpackhi_epi8(l0, h0);
      const __m256i v1 = _mm256_unpacklo_epi8(l1, h1), w1 = _mm256_unpackhi_epi8(l1, h1);
      __m256i* o = reinterpret_cast<__m256i*>(d + k);
      _mm256_storeu_si256(o, _mm256_permute2x128_si256(v0, w0, 0x20));
      _mm256_storeu_si256(o + 1, _mm256_permute2x128_si256(v1, w1, 0x20));
      _mm256_storeu_si256(o + 2, _mm256_permute2x128_si256(v0, w0, 0x31));
      _mm256_storeu_si256(o + 3, _mm256_permute2x128_si256(v1, w1, 0x31));
    }
  }
  if (b0 < hi) nf4_decode_loop(codes, scales, b0, hi, block, out + (b0 - lo));
}

// 32 source elements as 4 float vectors: float in element order; bf16 widened by interleaving
// with zeros (one unpack per 8 elements, where a widening load took two), so that vector k holds
// elements 16 (k / 2) + 4 (k % 2) + {0-3, 8-11}.
template <typename S>
FSDPN_AVX2 FSDPN_INLINE void load32_avx2(const S* p, __m256 v[4]) {
  if constexpr (std::is_same_v<S, float>) {
    for (int k = 0; k < 4; ++k) v[k] = _mm256_loadu_ps(p + 8 * k);
  } else {
    const __m256i z = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * h));
      v[2 * h] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, x));
      v[2 * h + 1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, x));
    }
  }
}

// The 32 int32 lanes of load32_avx2's 4 vectors as 32 bytes in element order, by the signed
// 32 -> 16 pack and the 16 -> 8 pack (signed saturation if `Signed`, else unsigned), which interleave
// the 128-bit lanes, and one permute that undoes it (the bf16 order needs 64-bit moves only).
template <typename S, bool Signed = false>
FSDPN_AVX2 FSDPN_INLINE __m256i bytes32_avx2(__m256i c0, __m256i c1, __m256i c2, __m256i c3) {
  const __m256i lo = _mm256_packs_epi32(c0, c1), hi = _mm256_packs_epi32(c2, c3);
  const __m256i b = Signed ? _mm256_packs_epi16(lo, hi) : _mm256_packus_epi16(lo, hi);
  if constexpr (std::is_same_v<S, float>) return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  return _mm256_permute4x64_epi64(b, 0xd8);
}

// fp8 encode, 32 elements per step, sources float or bf16: the e4m3 rounding in the float adder,
// as the AVX-512 kernel does (see there), with M computed instead of looked up: for
// a = min(|q|, 448) with biased exponent e and e'' = max(e - 121, 0) (below 2^-6 the subnormal
// step), M's bits are e'' (2^23 + 8) + 141 2^23, and the low byte of the bits of a + M is the
// code's magnitude. `Bounded` (the scale from the data: |q| < 464 for every finite x, which
// rounds to 448 at most) needs no clamp. The magnitudes and the signs of q (the signed packs
// keep a sign) are packed to bytes and merged 32 at a time. 32 elements with an inf or NaN q
// (a non-finite x, or an overflow of x / scale) take the loop, which knows the two apart.
// 8-9 operations per 8 elements and 15 per 32, where the integer steps took 23 per 8 and the
// first adder version 17 plus a pack; one vector shift per 8, since on Zen 3 the shifts share
// two pipes with the packs and permutes.
template <bool Bounded>
FSDPN_AVX2 FSDPN_INLINE __m256i fp8_mag8_avx2(__m256 x, __m256 inv, __m256i& qb, __m256i& q_abs) {
  qb = _mm256_castps_si256(_mm256_mul_ps(x, inv));
  q_abs = _mm256_and_si256(qb, _mm256_set1_epi32(0x7fffffff));
  const __m256i a = Bounded ? q_abs : _mm256_castps_si256(_mm256_min_ps(_mm256_castsi256_ps(q_abs), _mm256_set1_ps(kE4M3Max)));
  const __m256i e = _mm256_subs_epu16(_mm256_srli_epi32(a, 23), _mm256_set1_epi32(121));  // e < 2^16
  __m256i k = _mm256_set1_epi32((1 << 23) + 8);
  asm("" : "+x"(k));  // one VPMULLD: GCC would make it two shifts and two adds
  const __m256i m = _mm256_add_epi32(_mm256_mullo_epi32(e, k), _mm256_set1_epi32(141 << 23));
  const __m256i sum = _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(m)));
  return _mm256_and_si256(sum, _mm256_set1_epi32(0xff));
}

// `pf`: the next row, pulled into the cache while this one is encoded (fp8_rows_avx2), or null.
// `Checked`: look for inf and NaN q per 32 elements; not where the amax pass found the source
// finite and the scale came from it (then |q| < 464 everywhere: 6 operations per 32 fewer).
template <typename S, bool Bounded, bool Checked = true>
FSDPN_AVX2 FSDPN_INLINE void fp8_encode_avx2_impl(const S* x, int64_t n, float inv_scale, uint8_t* d, const char* pf) {
  static_assert(Checked || Bounded, "an unchecked encode needs a scale from the finite data");
  const __m256 inv = _mm256_set1_ps(inv_scale);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    if (pf != nullptr) {
      for (size_t b = 0; b < 32 * sizeof(S); b += 64) _mm_prefetch(pf + i * static_cast<int64_t>(sizeof(S)) + b, _MM_HINT_T0);
    }
    __m256 v[4];
    __m256i c[4], q[4], qa[4];
    load32_avx2(x + i, v);
    for (int k = 0; k < 4; ++k) c[k] = fp8_mag8_avx2<Bounded>(v[k], inv, q[k], qa[k]);
    if constexpr (Checked) {
      const __m256i big = _mm256_max_epi32(_mm256_max_epi32(qa[0], qa[1]), _mm256_max_epi32(qa[2], qa[3]));
      if (_mm256_movemask_epi8(_mm256_cmpgt_epi32(big, _mm256_set1_epi32(0x7f7fffff))) != 0) {
        fp8_encode_loop(x + i, 32, inv_scale, d + i);
        continue;
      }
    }
    const __m256i mag = bytes32_avx2<S>(c[0], c[1], c[2], c[3]);
    const __m256i sign = _mm256_and_si256(bytes32_avx2<S, true>(q[0], q[1], q[2], q[3]), _mm256_set1_epi8(static_cast<char>(0x80)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), _mm256_or_si256(mag, sign));
  }
  fp8_encode_loop(x + i, n - i, inv_scale, d + i);
}

template <typename S, bool Bounded, bool Checked = true>
FSDPN_AVX2 void fp8_encode_avx2(const void* src, int64_t n, float inv_scale, uint8_t* d) {
  fp8_encode_avx2_impl<S, Bounded, Checked>(static_cast<const S*>(src), n, inv_scale, d, nullptr);
}

// Largest |x| bits, inf and NaN included (an unsigned max of the |x| bits: NaN > inf > finite),
// as max_abs_loop, lane-wise over x[0, n - n % kStep) (two vectors at a time): 8 lanes of float
// bits. bf16 in 16-bit lanes, 2 operations per 16 elements, the pairs of lanes folded at the end.
template <typename S>
constexpr int64_t kMaxAbsStepAvx2 = 64 / sizeof(S);
template <typename S>
FSDPN_AVX2 FSDPN_INLINE __m256i max_abs_lanes_avx2(const S* x, int64_t n) {
  constexpr int64_t kStep = kMaxAbsStepAvx2<S>;
  __m256i m0 = _mm256_setzero_si256(), m1 = _mm256_setzero_si256();
  for (int64_t i = 0; i + kStep <= n; i += kStep) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i + kStep / 2));
    if constexpr (std::is_same_v<S, float>) {
      m0 = _mm256_max_epu32(m0, _mm256_and_si256(a, _mm256_set1_epi32(0x7fffffff)));
      m1 = _mm256_max_epu32(m1, _mm256_and_si256(b, _mm256_set1_epi32(0x7fffffff)));
    } else {
      m0 = _mm256_max_epu16(m0, _mm256_and_si256(a, _mm256_set1_epi16(0x7fff)));
      m1 = _mm256_max_epu16(m1, _mm256_and_si256(b, _mm256_set1_epi16(0x7fff)));
    }
  }
  if constexpr (std::is_same_v<S, float>) return _mm256_max_epu32(m0, m1);
  const __m256i m = _mm256_max_epu16(m0, m1);
  return _mm256_slli_epi32(_mm256_max_epu16(m, _mm256_srli_epi32(m, 16)), 16);  // the bf16 bits as float bits
}

// The same over all of x[0, n), folded to one value. A value of 0x7f800000 or more says that
// the finite amax needs its own pass.
template <typename S>
FSDPN_AVX2 uint32_t max_abs_avx2(const void* src, int64_t n) {
  const S* x = static_cast<const S*>(src);
  const int64_t i = n - n % kMaxAbsStepAvx2<S>;
  __m256i m = max_abs_lanes_avx2(x, i);
  m = _mm256_max_epu32(m, _mm256_permute2x128_si256(m, m, 0x01));
  m = _mm256_max_epu32(m, _mm256_shuffle_epi32(m, 0x4e));
  m = _mm256_max_epu32(m, _mm256_shuffle_epi32(m, 0xb1));
  return std::max(static_cast<uint32_t>(_mm256_cvtsi256_si32(m)), max_abs_loop(x + i, n - i));
}

// fp8_rowwise over whole rows: each row's amax (the cheap pass over every |x| first, the finite
// pass only for a row with an inf or NaN), its scale, then its codes by the bounded encode
// (without the inf / NaN check where the row is finite) while the next row is pulled into the
// cache (the amax pass waits on memory, the encode on arithmetic).
template <typename S>
FSDPN_AVX2 void fp8_rows_avx2(const void* src, int64_t row, int64_t rows, uint8_t* codes, uint8_t* scales) {
  const S* s = static_cast<const S*>(src);
  for (int64_t r = 0; r < rows; ++r) {
    const S* x = s + r * row;
    const uint32_t any = max_abs_avx2<S>(x, row);
    const bool finite = any < 0x7f800000u;
    const float scale = fp8_scale(bits_float(finite ? any : max_finite_abs_loop(x, row)));
    std::memcpy(scales + 4 * r, &scale, 4);
    const char* next = r + 1 < rows ? reinterpret_cast<const char*>(x + row) : nullptr;
    if (finite) {
      fp8_encode_avx2_impl<S, true, false>(x, row, 1.0f / scale, codes + r * row, next);
    } else {
      fp8_encode_avx2_impl<S, true>(x, row, 1.0f / scale, codes + r * row, next);
    }
  }
}

// NF4 encode: per whole block (a multiple of 32 elements), the largest |x| bits (unsigned max:
// inf and NaN included, as max_abs_loop) and nf4_scale as the loop; then per element the
// count of midpoints below v = x * (1 / scale), found in two steps of three compares (below),
// which gives the count the 15 compares did (each compare is "v > m", so a v equal to a
// midpoint and a NaN v go low: a NaN v is code 0). Two codes per byte. Other blocks take the
// loop.
struct Nf4Mids {
  float v[15];
  Nf4Mids() {
    for (uint32_t k = 0; k < 15; ++k) v[k] = (nf4_value(k) + nf4_value(k + 1)) * 0.5f;
  }
};
const Nf4Mids kNf4Mids;

// The code in few operations: a cubic h (kernels/quant.py NF4_CUBIC; fitted to k + 0.5 at the
// k-th midpoint) truncated is the count of midpoints below v or one less for every fp32 with
// |v| <= 1.001 (each one checked, fused multiply-adds as here: tests/test_quant_kernels.py
// --nf4-cubic), so one compare with midpoint k (two VPERMPS tables and a blend) finishes it:
// 10 operations per 8 elements where a search in two steps of three compares took 15. A NaN v
// truncates to INT_MIN, which the maximum makes 0, and its compare is false: code 0. The
// result is minus the code. Needs FMA: CPUs with AVX2 and without it take the loop.
#define FSDPN_AVX2_FMA __attribute__((target("avx2,fma")))

struct Nf4CubicAvx2 {
  __m256 lo, hi, c0, c1, c2, c3;  // midpoints 0-7 and 8-14 (the 16th never read)
  FSDPN_AVX2_FMA explicit Nf4CubicAvx2(const float* m) {
    lo = _mm256_loadu_ps(m);
    hi = _mm256_setr_ps(m[8], m[9], m[10], m[11], m[12], m[13], m[14], m[14]);
    c0 = _mm256_set1_ps(7.120029926300049f), c1 = _mm256_set1_ps(11.414050102233887f);
    c2 = _mm256_set1_ps(0.64410001039505f), c3 = _mm256_set1_ps(-4.424630165100098f);
  }
};

FSDPN_AVX2_FMA FSDPN_INLINE __m256i nf4_neg_codes8_avx2(__m256 v, const Nf4CubicAvx2& t) {
  const __m256 h = _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_fmadd_ps(v, t.c3, t.c2), v, t.c1), v, t.c0);
  const __m256i k = _mm256_max_epi32(_mm256_cvttps_epi32(h), _mm256_setzero_si256());
  const __m256 m = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t.lo, k), _mm256_permutevar8x32_ps(t.hi, k),
                                    _mm256_castsi256_ps(_mm256_slli_epi32(k, 28)));  // k > 7: the second table
  return _mm256_sub_epi32(_mm256_castps_si256(_mm256_cmp_ps(v, m, _CMP_GT_OQ)), k);
}

// The largest |x| bits of 8 whole blocks (lane j: block j; a block is a multiple of 32
// elements), as nf4_blocks_loop's max_abs_loop (unsigned max: inf and NaN included): each
// block's lanes by max_abs_lanes_avx2, then the 8 registers folded together by halves, so that
// the blocks' maxima land in one register: 21 operations per 8 blocks, where 8 horizontal maxima
// took 48 and a scalar chain.
template <typename S>
FSDPN_AVX2 FSDPN_INLINE __m256i nf4_amax8_avx2(const S* x, int64_t block) {
  __m256i m[8];
  for (int j = 0; j < 8; ++j) m[j] = max_abs_lanes_avx2(x + j * block, block);
  // Pairs of blocks: lanes (A0, B0, A1, B1) per 128 bits, A0 = max(a0, a2), A1 = max(a1, a3).
  __m256i p[4];
  for (int j = 0; j < 4; ++j)
    p[j] = _mm256_max_epu32(_mm256_unpacklo_epi32(m[2 * j], m[2 * j + 1]), _mm256_unpackhi_epi32(m[2 * j], m[2 * j + 1]));
  // Quads: lanes (A, B, C, D) per 128 bits.
  const __m256i q0 = _mm256_max_epu32(_mm256_unpacklo_epi64(p[0], p[1]), _mm256_unpackhi_epi64(p[0], p[1]));
  const __m256i q1 = _mm256_max_epu32(_mm256_unpacklo_epi64(p[2], p[3]), _mm256_unpackhi_epi64(p[2], p[3]));
  // The two 128-bit halves (elements 0-3 and 4-7 of each block's register) together.
  return _mm256_max_epu32(_mm256_permute2x128_si256(q0, q1, 0x20), _mm256_permute2x128_si256(q0, q1, 0x31));
}

// 32 elements' codes, two to a byte, into c[0, 16).
template <typename S>
FSDPN_AVX2_FMA FSDPN_INLINE void nf4_codes32_avx2(const S* s, __m256 inv, const Nf4CubicAvx2& mid, uint8_t* c) {
  __m256 v[4];
  __m256i code[4];
  load32_avx2(s, v);
  for (int j = 0; j < 4; ++j) code[j] = nf4_neg_codes8_avx2(_mm256_mul_ps(v[j], inv), mid);
  // Byte pairs (first, second) of the 32 negated codes as u16 lanes become 16 first + second
  // (one multiply-add of the bytes, the codes as its signed operand, then a negation; no
  // shifts), packed to 16 bytes.
  const __m256i b8 = bytes32_avx2<S, true>(code[0], code[1], code[2], code[3]);
  const __m256i pair = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_maddubs_epi16(_mm256_set1_epi16(0x0110), b8));
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi16(pair, pair), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(c), _mm256_castsi256_si128(packed));
}

// NF4 codes of one whole block (a multiple of 32 elements) at one inverse scale, 64 elements a
// step where the block allows (two independent 32-element steps in one iteration: 3 % faster on
// Zen 3).
template <typename S>
FSDPN_AVX2_FMA FSDPN_INLINE void nf4_block_avx2(const S* s, int64_t block, __m256 inv, const Nf4CubicAvx2& mid, uint8_t* c) {
  int64_t k = 0;
  for (; k + 64 <= block; k += 64) {
    nf4_codes32_avx2(s + k, inv, mid, c + k / 2);
    nf4_codes32_avx2(s + k + 32, inv, mid, c + k / 2 + 16);
  }
  if (k < block) nf4_codes32_avx2(s + k, inv, mid, c + k / 2);
}

// Runs of 8 whole blocks (while 8 blocks fit in 16 KiB, in L1 for the encode) get their amaxes,
// scales and inverse scales as vectors: one divide per 8 blocks, and no scalar step between a
// block's amax and its codes (that chain, about 45 cycles per 64-element block, is what the
// encode waited on). A NaN scale (inf or NaN in the block) makes every v NaN: code 0, as the loop.
template <typename S>
FSDPN_AVX2_FMA void nf4_blocks_avx2(const void* src, int64_t n, int64_t len, int64_t n_blocks, int64_t block,
                                    uint8_t* codes, uint8_t* scales) {
  const S* x = static_cast<const S*>(src);
  const Nf4CubicAvx2 mid(kNf4Mids.v);
  const int64_t whole = block % 32 == 0 && block * static_cast<int64_t>(sizeof(S)) <= 2048
                            ? std::min<int64_t>(n_blocks, std::max<int64_t>(0, std::min(n, len)) / block)
                            : 0;
  int64_t b = 0;
  for (; b + 8 <= whole; b += 8) {
    const S* s = x + b * block;
    // nf4_scale of each amax: 1 for 0, the smallest normal below it, NaN for inf / NaN.
    const __m256i amax = nf4_amax8_avx2(s, block);
    const __m256i bad = _mm256_cmpgt_epi32(amax, _mm256_set1_epi32(0x7f7fffff));  // amax <= 0x7fffffff
    __m256i bits = _mm256_max_epu32(amax, _mm256_set1_epi32(0x00800000));
    bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x3f800000), _mm256_cmpeq_epi32(amax, _mm256_setzero_si256()));
    bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(static_cast<int>(kNaNBits)), bad);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(scales + 4 * b), bits);
    const __m256 inv = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_castsi256_ps(bits));
    for (int j = 0; j < 8; ++j)
      nf4_block_avx2(s + j * block, block, _mm256_permutevar8x32_ps(inv, _mm256_set1_epi32(j)), mid, codes + (b + j) * block / 2);
  }
  for (; b < n_blocks; ++b) {
    const int64_t lo = b * block;
    if (block % 32 != 0 || lo + block > n) {  // a short or partial block: the loop
      nf4_blocks_loop(x + lo, n - lo, len - lo, 1, block, codes + lo / 2, scales + 4 * b);
      continue;
    }
    const S* s = x + lo;
    const float scale = nf4_scale(max_abs_avx2<S>(s, block));
    std::memcpy(scales + 4 * b, &scale, 4);
    nf4_block_avx2(s, block, _mm256_set1_ps(1.0f / scale), mid, codes + lo / 2);
  }
}

// fp8 decode into bf16 by a table: per call (one scale: a rank's shard, or one row) the 256
// values store_value(e4m3_to_float(code) * scale), the same bits as the loop's per element,
// then 8 elements per 32-bit gather (faster here than one scalar table load per element:
// 23 against 33 ms on the Llama-style layer). Short calls (a table per few elements) take
// the loop.
struct E4m3Table {
  float v[256];
  E4m3Table() {
    for (uint32_t k = 0; k < 256; ++k) v[k] = e4m3_to_float(k);
  }
};
alignas(64) const E4m3Table kE4m3Table;

FSDPN_AVX2 void fp8_decode_avx2_bf16(const uint8_t* codes, int64_t n, float scale, void* dst) {
  bf16_t* d = static_cast<bf16_t*>(dst);
  if (n < 1024) {
    fp8_decode_loop(codes, n, scale, d);
    return;
  }
  alignas(32) int32_t table[256];  // bf16 bits in the low half, for 32-bit gathers
  const __m256 s = _mm256_set1_ps(scale);
  for (int k = 0; k < 256; k += 8) {
    const __m256i x = _mm256_castps_si256(_mm256_mul_ps(_mm256_load_ps(kE4m3Table.v + k), s));
    _mm256_store_si256(reinterpret_cast<__m256i*>(table + k), bf16_bits8_avx2(x));
  }
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i));
    const __m256i v0 = _mm256_i32gather_epi32(table, _mm256_cvtepu8_epi32(c), 4);
    const __m256i v1 = _mm256_i32gather_epi32(table, _mm256_cvtepu8_epi32(_mm_srli_si128(c, 8)), 4);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), _mm256_permute4x64_epi64(_mm256_packus_epi32(v0, v1), 0xd8));
  }
  for (; i < n; ++i) d[i].x = static_cast<uint16_t>(table[codes[i]]);
}

// fp8 decode with F16C (every AVX2 CPU has it), as fp8_decode_x512 does: the code's sign,
// exponent and mantissa bits moved into an fp16 are the e4m3 value times 2^-8, exactly, which
// VCVTPH2PS widens; times 256 scale (exact while |scale| <= 2^100) that is code * scale with
// one rounding. bf16 by the integer rounding (subnormal products included: no instruction
// flushes them). NaN codes (0x7f, 0xff) store the canonical NaN. 32 codes per step, no
// gathers: 23 -> 13.4 ms into bf16 on the Llama-style layer shard, against the table; 12.7 ->
// 9.6 ms with the even and odd elements apart (below). Other scales take the table (bf16) or
// the loop (fp32).
#define FSDPN_F16C __attribute__((target("avx2,f16c")))

// e4m3 bytes (16, sign-extended to 16 bits) as fp16 bits: e4m3 value * 2^-8.
FSDPN_F16C FSDPN_INLINE __m256i e4m3_fp16_bits16(__m128i b) {
  return _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7), _mm256_set1_epi16(static_cast<short>(0xbf80)));
}

template <typename D>
FSDPN_F16C void fp8_decode_f16c(const uint8_t* c, int64_t n, float scale, void* dst) {
  D* d = static_cast<D*>(dst);
  if (!(std::fabs(scale) <= 0x1p100f)) {
    if constexpr (std::is_same_v<D, float>) {
      fp8_decode_loop(c, n, scale, d);
    } else {
      fp8_decode_avx2_bf16(c, n, scale, dst);
    }
    return;
  }
  const __m256 sc = _mm256_set1_ps(scale * 256.0f);
  const __m256i nan_code = _mm256_set1_epi8(static_cast<char>(0xfe));  // 2 code, for 0x7f and 0xff
  int64_t i = 0;
  if constexpr (!std::is_same_v<D, float>) {
    // bf16: the even and the odd elements apart, straight from the code bytes read as 16-bit
    // words (an arithmetic shift right by one puts a word's high byte, sign and magnitude, where
    // fp16 wants them; the low byte is shifted up first), so that after the rounding one blend
    // of the even elements' high halves, moved down, with the odd ones' gives 16 bf16 in element
    // order: two vector shifts per 8 elements fewer than widening the codes in order, and no packs.
    const __m256i fp16_mask = _mm256_set1_epi16(static_cast<short>(0xbf80));
    for (; i + 32 <= n; i += 32) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + i));
      const __m256i nan = _mm256_cmpeq_epi8(_mm256_add_epi8(b, b), nan_code);
      const __m256i odd = _mm256_and_si256(_mm256_srai_epi16(b, 1), fp16_mask);
      const __m256i even = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(b, 8), 1), fp16_mask);
      for (int h = 0; h < 2; ++h) {
        const __m128i eh = h == 0 ? _mm256_castsi256_si128(even) : _mm256_extracti128_si256(even, 1);
        const __m128i oh = h == 0 ? _mm256_castsi256_si128(odd) : _mm256_extracti128_si256(odd, 1);
        const __m128i nh = h == 0 ? _mm256_castsi256_si128(nan) : _mm256_extracti128_si256(nan, 1);
        const __m256i re = bf16_round_hi_avx2(_mm256_castps_si256(_mm256_mul_ps(_mm256_cvtph_ps(eh), sc)));
        const __m256i ro = bf16_round_hi_avx2(_mm256_castps_si256(_mm256_mul_ps(_mm256_cvtph_ps(oh), sc)));
        const __m256i r = _mm256_blend_epi16(_mm256_srli_epi32(re, 16), ro, 0xaa);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i + 16 * h),
                            _mm256_blendv_epi8(r, _mm256_set1_epi16(0x7fc0), _mm256_cvtepi8_epi16(nh)));
      }
    }
  }
  for (; i + 32 <= n; i += 32) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + i));
    const __m256i nan = _mm256_cmpeq_epi8(_mm256_add_epi8(b, b), nan_code);
    for (int h = 0; h < 2; ++h) {
      const __m128i bh = h == 0 ? _mm256_castsi256_si128(b) : _mm256_extracti128_si256(b, 1);
      const __m128i nh = h == 0 ? _mm256_castsi256_si128(nan) : _mm256_extracti128_si256(nan, 1);
      const __m256i w = e4m3_fp16_bits16(bh);
      const __m256 v0 = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(w)), sc);
      const __m256 v1 = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(w, 1)), sc);
      D* o = d + i + 16 * h;
      if constexpr (std::is_same_v<D, float>) {
        const __m256 q = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(kNaNBits)));
        _mm256_storeu_ps(o, _mm256_blendv_ps(v0, q, _mm256_castsi256_ps(_mm256_cvtepi8_epi32(nh))));
        _mm256_storeu_ps(o + 8, _mm256_blendv_ps(v1, q, _mm256_castsi256_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(nh, 8)))));
      } else {
        const __m256i r = _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_bits8_finite_avx2(_mm256_castps_si256(v0)),
                                                                     bf16_bits8_finite_avx2(_mm256_castps_si256(v1))), 0xd8);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm256_blendv_epi8(r, _mm256_set1_epi16(0x7fc0), _mm256_cvtepi8_epi16(nh)));
      }
    }
  }
  fp8_decode_loop(c + i, n - i, scale, d + i);
}

// NF4 decode into fp32: per block, the 16 values store_value(t[k] * scale) in two registers,
// looked up by VPERMPS (the low 3 bits of the code) and chosen by its bit 3; 32 elements (16
// code bytes) per step. Blocks that are not whole multiples of 32 elements take the loop.
FSDPN_AVX2 void nf4_decode_avx2_float(const uint8_t* codes, const uint8_t* scales, int64_t lo, int64_t hi,
                                      int64_t block, void* dst) {
  float* out = static_cast<float*>(dst);
  const __m128i low4 = _mm_set1_epi8(0x0f);
  const __m256i qnan = _mm256_set1_epi32(static_cast<int>(kNaNBits));
  int64_t b0 = lo;
  for (; b0 < hi; b0 += block) {
    if (block % 32 != 0 || b0 + block > hi) break;  // the loop takes the rest
    float scale;
    std::memcpy(&scale, scales + 4 * (b0 / block), 4);
    const __m256 s = _mm256_set1_ps(scale);
    __m256 t[2];
    for (int h = 0; h < 2; ++h) {
      const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(kNf4Table.v + 8 * h), s);
      t[h] = _mm256_blendv_ps(v, _mm256_castsi256_ps(qnan), _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    const uint8_t* c = codes + b0 / 2;
    float* d = out + (b0 - lo);
    for (int64_t k = 0; k < block; k += 32) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + k / 2));
      const __m128i first = _mm_and_si128(_mm_srli_epi16(b, 4), low4), second = _mm_and_si128(b, low4);
      const __m128i e[2] = {_mm_unpacklo_epi8(first, second), _mm_unpackhi_epi8(first, second)};
      for (int q = 0; q < 4; ++q) {
        const __m256i idx = _mm256_cvtepu8_epi32(q % 2 == 0 ? e[q / 2] : _mm_srli_si128(e[q / 2], 8));
        const __m256 v = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t[0], idx), _mm256_permutevar8x32_ps(t[1], idx),
                                          _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
        _mm256_storeu_ps(d + k + 8 * q, v);
      }
    }
  }
  if (b0 < hi) nf4_decode_loop(codes, scales, b0, hi, block, out + (b0 - lo));
}

// --- AVX-512 with VBMI, BF16 and the fp16 conversions (Ice Lake, Sapphire Rapids, Zen 4) ------
//
// The same bytes and values as the portable loops, in fewer instructions:
//  * fp8 encode: e4m3 rounding in the float adder. For a = min(|q|, 448) with exponent E
//    (E >= -6; below 2^-6, E = -6), M = 2^(E+20) + 8 (E+6) * 2^(E-3) has the ulp 2^(E-3), e4m3's
//    step at E (2^-9, the subnormal step, at E = -6), so a + M rounds a to e4m3 (nearest, and
//    even: M's mantissa 8 (E+6) is even) and the low byte of the sum's bits is the e4m3 code:
//    8 (E+6) + round(a / 2^(E-3)). M comes from a 32-entry table indexed by the exponent.
//  * fp8 decode: the code's exponent and mantissa bits moved into an fp16 (code 0x7f -> 0x3f80)
//    are the e4m3 value times 2^-8, exactly (e4m3 subnormals are fp16 subnormals), which the
//    fp16 conversion widens; the 2^8 goes into the scale (exact while |scale| <= 2^100).
//  * bf16 stores by VCVTNE2PS2BF16 (nearest even, like store_value) where no product can be
//    subnormal (the instruction flushes those): else the integer rounding.
//  * NF4 encode: 32 uniform buckets over [-1, 1] (each holding at most one midpoint; the
//    bucket function is monotone, so the code is the count of midpoints in lower buckets plus
//    one compare); NF4 decode: nibbles to table indices by one VPMULTISHIFTQB.
#define FSDPN_X512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512bf16,f16c,fma")))

bool have_avx512x() {
  static const bool v = [] {
    __builtin_cpu_init();
    return have_avx512() && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vbmi") &&
           __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
  }();
  return v && isa_cap() >= 3;
}

// M of the e4m3 rounding (above) by biased exponent & 31, for the exponents 104 (2^-23) ..
// 135 (256 .. 448): below 2^-6 it is 2^14 (the subnormal step); a below 2^-23 is raised to
// 2^-23 first, which keeps its code (0: anything below 2^-10 rounds to 0).
constexpr uint32_t fp8_round_entry(uint32_t i) {
  const uint32_t e = i >= 8 ? i + 96 : i + 128;
  return e <= 121 ? 141u << 23 : ((e + 20) << 23) | ((e - 121) << 3);
}
#define FSDPN_R4(i) fp8_round_entry(i), fp8_round_entry(i + 1), fp8_round_entry(i + 2), fp8_round_entry(i + 3)
alignas(64) constexpr uint32_t kFp8Round[32] = {FSDPN_R4(0),  FSDPN_R4(4),  FSDPN_R4(8),  FSDPN_R4(12),
                                                FSDPN_R4(16), FSDPN_R4(20), FSDPN_R4(24), FSDPN_R4(28)};
#undef FSDPN_R4

// VFIXUPIMMPS table: NaN (quiet, signaling) and +-inf give MAX_FLOAT (low byte 0xff), the
// other classes keep the destination.
constexpr int kFixupNonFinite = 0x00ee00ee;

// Codes of 16 floats x (times inv) in the low byte of each lane, without the sign; 0xff where
// x is not finite. `Clamp`: |x * inv| may exceed 448 (a given amax); without it, |x * inv| < 464
// (the scale from the finite amax: 448 (1 + 2^-21) at most), whose code is 448's. `Finite`: the
// caller knows every x is finite (a row whose amax pass saw no inf or NaN), so the non-finite
// fix-up is left out (the codes of finite x are the same: at most 0x7e).
template <bool Clamp, bool Finite = false>
FSDPN_X512 FSDPN_INLINE __m512i fp8_codes16(__m512 x, __m512 inv, __m512 tlo, __m512 thi) {
  __m512 q = _mm512_mul_ps(x, inv);
  if constexpr (Clamp) q = _mm512_range_ps(q, _mm512_set1_ps(kE4M3Max), 0x0A);  // min(|q|, 448)
  const __m512 a = _mm512_range_ps(q, _mm512_set1_ps(0x1p-23f), 0x0B);          // max(|q|, 2^-23)
  const __m512 s = _mm512_add_ps(a, _mm512_permutex2var_ps(tlo, _mm512_srli_epi32(_mm512_castps_si512(a), 23), thi));
  if constexpr (Finite) return _mm512_castps_si512(s);
  return _mm512_castps_si512(_mm512_fixupimm_ps(s, x, _mm512_set1_epi32(kFixupNonFinite), 0));
}

// The final bytes from those low bytes c and the bytes h holding the sign of x in bit 7:
// bits 0-6 of c, bit 7: sign and not bit 7 of c (0xff, non-finite x: 0x7f).
FSDPN_X512 FSDPN_INLINE __m512i fp8_sign(__m512i c, __m512i h) {
  return _mm512_ternarylogic_epi32(c, h, _mm512_set1_epi32(0x80808080u), 0x58);
}

// `pf`: where to prefetch, one source-sized stride ahead of each element (the next row).
template <typename S, bool Clamp, bool Finite = false>
FSDPN_X512 void fp8_encode_x512(const void* src, int64_t n, float inv_scale, uint8_t* d, const char* pf = nullptr) {
  const S* s = static_cast<const S*>(src);
  const int64_t pf_off = pf == nullptr ? 0 : pf - static_cast<const char*>(src);
  const __m512 inv = _mm512_set1_ps(inv_scale);
  const __m512 tlo = _mm512_load_ps(reinterpret_cast<const float*>(kFp8Round));
  const __m512 thi = _mm512_load_ps(reinterpret_cast<const float*>(kFp8Round) + 16);
  int64_t i = 0;
  if constexpr (std::is_same<S, bf16_t>::value) {
    // 64 elements from two loads of 32: the even elements (<< 16) and the odd ones (& high
    // half) of each; one byte permutation puts the codes back in order, another gathers the
    // high bytes (signs).
    alignas(64) static constexpr uint8_t kIdx[128] = {
#define FSDPN_P(e) static_cast<uint8_t>(((e) & 1) ? 64 + 2 * ((e) - 1) : 2 * (e))
#define FSDPN_P8(e) FSDPN_P(e), FSDPN_P(e + 1), FSDPN_P(e + 2), FSDPN_P(e + 3), FSDPN_P(e + 4), FSDPN_P(e + 5), FSDPN_P(e + 6), FSDPN_P(e + 7)
        FSDPN_P8(0), FSDPN_P8(8), FSDPN_P8(16), FSDPN_P8(24), FSDPN_P8(0), FSDPN_P8(8), FSDPN_P8(16), FSDPN_P8(24),
#undef FSDPN_P
#define FSDPN_P(e) static_cast<uint8_t>(2 * (e) + 1)
        FSDPN_P8(0), FSDPN_P8(8), FSDPN_P8(16), FSDPN_P8(24), FSDPN_P8(32), FSDPN_P8(40), FSDPN_P8(48), FSDPN_P8(56)
#undef FSDPN_P8
#undef FSDPN_P
    };
    const __m512i idx = _mm512_load_si512(kIdx), idx_high = _mm512_load_si512(kIdx + 64);
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
    for (; i + 64 <= n; i += 64) {
      if (pf_off != 0) {
        _mm_prefetch(reinterpret_cast<const char*>(s + i) + pf_off, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(s + i) + pf_off + 64, _MM_HINT_T0);
      }
      const __m512i a = _mm512_loadu_si512(s + i), b = _mm512_loadu_si512(s + i + 32);
      const __m512i a0 = fp8_codes16<Clamp, Finite>(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), inv, tlo, thi);
      const __m512i a1 = fp8_codes16<Clamp, Finite>(_mm512_castsi512_ps(_mm512_and_si512(a, high)), inv, tlo, thi);
      const __m512i b0 = fp8_codes16<Clamp, Finite>(_mm512_castsi512_ps(_mm512_slli_epi32(b, 16)), inv, tlo, thi);
      const __m512i b1 = fp8_codes16<Clamp, Finite>(_mm512_castsi512_ps(_mm512_and_si512(b, high)), inv, tlo, thi);
      const __m512i c = _mm512_mask_blend_epi64(0xf0, _mm512_permutex2var_epi8(a0, idx, a1), _mm512_permutex2var_epi8(b0, idx, b1));
      _mm512_storeu_si512(d + i, fp8_sign(c, _mm512_permutex2var_epi8(a, idx_high, b)));
    }
  } else {
    alignas(64) static constexpr uint8_t kIdx[128] = {
#define FSDPN_P8(e) FSDPN_P(e), FSDPN_P(e + 1), FSDPN_P(e + 2), FSDPN_P(e + 3), FSDPN_P(e + 4), FSDPN_P(e + 5), FSDPN_P(e + 6), FSDPN_P(e + 7)
#define FSDPN_P(e) static_cast<uint8_t>((e) < 16 ? 4 * (e) : 64 + 4 * ((e) - 16))
        FSDPN_P8(0), FSDPN_P8(8), FSDPN_P8(16), FSDPN_P8(24), FSDPN_P8(0), FSDPN_P8(8), FSDPN_P8(16), FSDPN_P8(24),
#undef FSDPN_P
#define FSDPN_P(e) static_cast<uint8_t>(((e) < 16 ? 4 * (e) : 64 + 4 * ((e) - 16)) + 3)
        FSDPN_P8(0), FSDPN_P8(8), FSDPN_P8(16), FSDPN_P8(24), FSDPN_P8(0), FSDPN_P8(8), FSDPN_P8(16), FSDPN_P8(24)
#undef FSDPN_P8
#undef FSDPN_P
    };
    const __m512i idx = _mm512_load_si512(kIdx), idx_high = _mm512_load_si512(kIdx + 64);
    for (; i + 64 <= n; i += 64) {
      __m512i x[4], c[4];
      for (int j = 0; j < 4; ++j) {
        if (pf_off != 0) _mm_prefetch(reinterpret_cast<const char*>(s + i + 16 * j) + pf_off, _MM_HINT_T0);
        x[j] = _mm512_loadu_si512(s + i + 16 * j);
        c[j] = fp8_codes16<Clamp, Finite>(_mm512_castsi512_ps(x[j]), inv, tlo, thi);
      }
      const __m512i h = _mm512_mask_blend_epi64(0xf0, _mm512_permutex2var_epi8(x[0], idx_high, x[1]),
                                                _mm512_permutex2var_epi8(x[2], idx_high, x[3]));
      _mm512_storeu_si512(d + i, fp8_sign(_mm512_mask_blend_epi64(0xf0, _mm512_permutex2var_epi8(c[0], idx, c[1]),
                                                                  _mm512_permutex2var_epi8(c[2], idx, c[3])), h));
    }
  }
  for (; i + 16 <= n; i += 16) {
    const __m512i xb = load16_bits(s + i);
    const __m512i c = fp8_sign(fp8_codes16<Clamp, Finite>(_mm512_castsi512_ps(xb), inv, tlo, thi), _mm512_srli_epi32(xb, 24));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), _mm512_cvtepi32_epi8(c));
  }
  for (; i < n; ++i) d[i] = fp8_encode(to_float(s[i]), inv_scale);
}

// Largest |x| bits over the finite x, as max_finite_abs_loop. bf16 in 16-bit lanes: 2 x + 0x100
// (mod 2^16) drops the sign and is 2 |x| + 0x100 for finite x, below 0x100 for inf and NaN
// (2 |x| >= 0xff00 wraps), so one unsigned max finds the finite amax (float: the same in 32 bits).
FSDPN_X512 uint32_t max_finite_abs_x512_bf16(const void* src, int64_t n) {
  const uint16_t* s = static_cast<const uint16_t*>(src);
  const __m512i k = _mm512_set1_epi16(0x100);
  __m512i m0 = _mm512_setzero_si512(), m1 = _mm512_setzero_si512();
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m512i a = _mm512_loadu_si512(s + i), b = _mm512_loadu_si512(s + i + 32);
    m0 = _mm512_max_epu16(m0, _mm512_add_epi16(_mm512_add_epi16(a, a), k));
    m1 = _mm512_max_epu16(m1, _mm512_add_epi16(_mm512_add_epi16(b, b), k));
  }
  for (; i < n; i += 32) {  // zeros past the end count as +0
    const __m512i a = _mm512_maskz_loadu_epi16(n - i >= 32 ? ~__mmask32{0} : (__mmask32{1} << (n - i)) - 1, s + i);
    m0 = _mm512_max_epu16(m0, _mm512_add_epi16(_mm512_add_epi16(a, a), k));
  }
  const __m512i m = _mm512_max_epu16(m0, m1);
  const __m256i m2 = _mm256_max_epu16(_mm512_castsi512_si256(m), _mm512_extracti64x4_epi64(m, 1));
  const __m128i m4 = _mm_max_epu16(_mm256_castsi256_si128(m2), _mm256_extracti128_si256(m2, 1));
  const uint32_t r = 0xffffu & ~static_cast<uint32_t>(_mm_cvtsi128_si32(_mm_minpos_epu16(_mm_xor_si128(m4, _mm_set1_epi32(-1)))));
  return r < 0x100u ? 0u : ((r - 0x100u) >> 1) << 16;
}

FSDPN_X512 uint32_t max_finite_abs_x512_float(const void* src, int64_t n) {
  const uint32_t* s = static_cast<const uint32_t*>(src);
  const __m512i k = _mm512_set1_epi32(0x01000000);
  __m512i m0 = _mm512_setzero_si512(), m1 = _mm512_setzero_si512();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512i a = _mm512_loadu_si512(s + i), b = _mm512_loadu_si512(s + i + 16);
    m0 = _mm512_max_epu32(m0, _mm512_add_epi32(_mm512_add_epi32(a, a), k));
    m1 = _mm512_max_epu32(m1, _mm512_add_epi32(_mm512_add_epi32(b, b), k));
  }
  for (; i < n; i += 16) {
    const __m512i a = _mm512_maskz_loadu_epi32(n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1), s + i);
    m0 = _mm512_max_epu32(m0, _mm512_add_epi32(_mm512_add_epi32(a, a), k));
  }
  const uint32_t r = _mm512_reduce_max_epu32(_mm512_max_epu32(m0, m1));
  return r < 0x01000000u ? 0u : (r - 0x01000000u) >> 1;
}

template <typename S, bool Clamp, bool Finite = false>
FSDPN_X512 void fp8_encode_x512_fn(const void* src, int64_t n, float inv_scale, uint8_t* d) {
  fp8_encode_x512<S, Clamp, Finite>(src, n, inv_scale, d);
}

FSDPN_X512 FSDPN_INLINE uint32_t hmax_epu16(__m512i m) {
  const __m256i m2 = _mm256_max_epu16(_mm512_castsi512_si256(m), _mm512_extracti64x4_epi64(m, 1));
  const __m128i m4 = _mm_max_epu16(_mm256_castsi256_si128(m2), _mm256_extracti128_si256(m2, 1));
  return 0xffffu & ~static_cast<uint32_t>(_mm_cvtsi128_si32(_mm_minpos_epu16(_mm_xor_si128(m4, _mm_set1_epi32(-1)))));
}

// Largest |x| bits over all x, inf and NaN included (at or above 0x7f800000 if the range has
// one): one AND and one max per vector, against max_finite_abs_x512_*'s three ops. bf16 in
// 16-bit lanes (the result shifted to float bits), float in 32-bit lanes.
template <typename S>
FSDPN_X512 FSDPN_INLINE __m512i max_abs_step(__m512i m, __m512i x) {
  if constexpr (std::is_same<S, bf16_t>::value) return _mm512_max_epu16(m, _mm512_and_si512(x, _mm512_set1_epi16(0x7fff)));
  return _mm512_max_epu32(m, _mm512_and_si512(x, _mm512_set1_epi32(0x7fffffff)));
}

template <typename S>
FSDPN_X512 uint32_t max_abs_x512(const void* src, int64_t n) {
  constexpr bool kBf16 = std::is_same<S, bf16_t>::value;
  constexpr int64_t kLanes = kBf16 ? 32 : 16;
  const S* s = static_cast<const S*>(src);
  __m512i m0 = _mm512_setzero_si512(), m1 = _mm512_setzero_si512();
  int64_t i = 0;
  for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
    m0 = max_abs_step<S>(m0, _mm512_loadu_si512(s + i));
    m1 = max_abs_step<S>(m1, _mm512_loadu_si512(s + i + kLanes));
  }
  for (; i < n; i += kLanes) {  // zeros past the end count as +0
    const int64_t left = n - i;
    if constexpr (kBf16) {
      m0 = max_abs_step<S>(m0, _mm512_maskz_loadu_epi16(left >= 32 ? ~__mmask32{0} : (__mmask32{1} << left) - 1, s + i));
    } else {
      m0 = max_abs_step<S>(m0, _mm512_maskz_loadu_epi32(left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1), s + i));
    }
  }
  if constexpr (kBf16) return hmax_epu16(_mm512_max_epu16(m0, m1)) << 16;
  return _mm512_reduce_max_epu32(_mm512_max_epu32(m0, m1));
}

// fp8_rowwise over `rows` whole rows of `row` elements: each row's amax, scale and codes, the
// next row prefetched while this one is encoded (the amax pass then reads it from the cache).
// A row without inf or NaN (the common case) takes the cheaper amax pass and the encode without
// the non-finite fix-up; a row with one, the finite amax pass and the full encode.
template <typename S>
FSDPN_X512 void fp8_rows_x512(const void* src, int64_t row, int64_t rows, uint8_t* codes, uint8_t* scales) {
  constexpr bool kFloat = std::is_same<S, float>::value;
  const S* s = static_cast<const S*>(src);
  for (int64_t r = 0; r < rows; ++r) {
    const S* x = s + r * row;
    const char* pf = r + 1 < rows ? reinterpret_cast<const char*>(x + row) : nullptr;
    uint32_t amax = max_abs_x512<S>(x, row);
    const bool finite = amax < 0x7f800000u;
    if (!finite) amax = kFloat ? max_finite_abs_x512_float(x, row) : max_finite_abs_x512_bf16(x, row);
    const float scale = fp8_scale(bits_float(amax));
    std::memcpy(scales + 4 * r, &scale, 4);
    if (finite) {
      fp8_encode_x512<S, false, true>(x, row, 1.0f / scale, codes + r * row, pf);
    } else {
      fp8_encode_x512<S, false>(x, row, 1.0f / scale, codes + r * row, pf);
    }
  }
}


// NF4 encode. Bucket of v: the low 5 bits of fma(v, 15.4, 1.5 * 2^23 + 16), i.e. round(15.4 v)
// + 16, in 1 .. 31 for |v| <= 1 + 2^-20 (v = x / amax of the block) and 0 for NaN. The bucket is
// a monotone function of v and no two midpoints (at least 0.08 apart) share one, so the code
// (the number of midpoints below v) is the number in lower buckets plus (v > the bucket's
// midpoint, if any). The tables are built with the same fma on the midpoints.
constexpr float kNf4BucketMul = 15.4f, kNf4BucketAdd = 12582928.0f;  // 1.5 * 2^23 + 16
struct Nf4Buckets {
  alignas(64) float mid[32];      // the bucket's midpoint, or NaN (no compare is true)
  alignas(64) int32_t count[32];  // midpoints in lower buckets
  alignas(64) int32_t count16[32];
  bool ok;                        // every bucket holds at most one midpoint
};
const Nf4Buckets& nf4_buckets() {
  static const Nf4Buckets t = [] {
    Nf4Buckets b{};
    constexpr float m[15] = {-0x1.b239bp-1f, -0x1.38a4ep-1f, -0x1.d709p-2f, -0x1.5bd4ecp-2f, -0x1.e079d8p-3f,
                             -0x1.1a7178p-3f, -0x1.74f0e2p-5f, 0x1.45f5fep-5f, 0x1.ec90c4p-4f, 0x1.a0cfcp-3f,
                             0x1.2b05a8p-2f, 0x1.8ea7f2p-2f, 0x1.00da08p-1f, 0x1.491b5ep-1f, 0x1.b913b4p-1f};
    for (int i = 0; i < 32; ++i) b.mid[i] = bits_float(kNaNBits);
    int bucket[15];
    b.ok = true;
    for (int k = 0; k < 15; ++k) {
      bucket[k] = static_cast<int>(float_bits(std::fma(m[k], kNf4BucketMul, kNf4BucketAdd)) & 31u);
      if (b.mid[bucket[k]] == b.mid[bucket[k]] || bucket[k] == 0) b.ok = false;  // shared, or NaN's bucket
      b.mid[bucket[k]] = m[k];
    }
    for (int i = 0; i < 32; ++i) {
      for (int k = 0; k < 15; ++k) b.count[i] += bucket[k] < i;
      b.count16[i] = 16 * b.count[i];
    }
    return b;
  }();
  return t;
}

// Codes of 16 values v (times `unit`: 1 or 16) in each lane.
FSDPN_X512 FSDPN_INLINE __m512i nf4_codes16x(__m512 v, const __m512* mid, __m512i count_lo, __m512i count_hi, __m512i unit) {
  const __m512i b = _mm512_castps_si512(_mm512_fmadd_ps(v, _mm512_set1_ps(kNf4BucketMul), _mm512_set1_ps(kNf4BucketAdd)));
  const __m512i c = _mm512_permutex2var_epi32(count_lo, b, count_hi);
  return _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(v, _mm512_permutex2var_ps(mid[0], b, mid[1]), _CMP_GT_OQ), c, unit);
}

struct Nf4Regs {
  __m512 mid[2];
  __m512i c_lo, c_hi, c16_lo, c16_hi;
};
FSDPN_X512 FSDPN_INLINE Nf4Regs nf4_regs(const Nf4Buckets& t) {
  return {{_mm512_load_ps(t.mid), _mm512_load_ps(t.mid + 16)},
          _mm512_load_si512(t.count), _mm512_load_si512(t.count + 16),
          _mm512_load_si512(t.count16), _mm512_load_si512(t.count16 + 16)};
}

// 16 bytes of codes (in the low byte of each lane) of elements [0, 32) of x: lane k holds
// elements 2 k (high nibble) and 2 k + 1.
template <typename S>
FSDPN_X512 FSDPN_INLINE __m512i nf4_group32(const S* x, __m512 inv, const Nf4Regs& t) {
  __m512 xe, xo;
  if constexpr (std::is_same<S, bf16_t>::value) {
    const __m512i a = _mm512_loadu_si512(x);
    xe = _mm512_castsi512_ps(_mm512_slli_epi32(a, 16));
    xo = _mm512_castsi512_ps(_mm512_and_si512(a, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
  } else {
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
    xe = _mm512_permutex2var_ps(a, even, b);
    xo = _mm512_permutex2var_ps(a, _mm512_add_epi32(even, _mm512_set1_epi32(1)), b);
  }
  return _mm512_add_epi32(nf4_codes16x(_mm512_mul_ps(xe, inv), t.mid, t.c16_lo, t.c16_hi, _mm512_set1_epi32(16)),
                          nf4_codes16x(_mm512_mul_ps(xo, inv), t.mid, t.c_lo, t.c_hi, _mm512_set1_epi32(1)));
}

// Lane-wise unsigned max in the source's lanes: 16-bit for bf16, 32-bit for float.
template <typename S>
FSDPN_X512 FSDPN_INLINE __m512i max_lanes(__m512i a, __m512i b) {
  if constexpr (std::is_same<S, bf16_t>::value) return _mm512_max_epu16(a, b);
  return _mm512_max_epu32(a, b);
}

// The largest |x| bits of 16 consecutive whole blocks of `block` elements, block j's in lane
// j (float bits; inf and NaN included, at or above 0x7f800000). Each block's lanes are folded
// by halves while the blocks are interleaved (two blocks per register after the first fold,
// four, eight, then all 16): about 3 operations per block instead of a horizontal max each.
template <typename S>
FSDPN_X512 FSDPN_INLINE __m512i nf4_amax16(const S* x, int64_t block) {
  constexpr bool kBf16 = std::is_same<S, bf16_t>::value;
  constexpr int64_t kStep = kBf16 ? 32 : 16;
  __m512i m[16];
  for (int j = 0; j < 16; ++j) {
    const S* xb = x + j * block;
    __m512i a = _mm512_setzero_si512();
    for (int64_t k = 0; k < block; k += kStep) a = max_abs_step<S>(a, _mm512_loadu_si512(xb + k));
    m[j] = a;
  }
  // 256-bit halves: register p holds blocks 2p (128-bit lanes 0-1) and 2p + 1 (lanes 2-3).
  for (int p = 0; p < 8; ++p)
    m[p] = max_lanes<S>(_mm512_shuffle_i64x2(m[2 * p], m[2 * p + 1], 0x44), _mm512_shuffle_i64x2(m[2 * p], m[2 * p + 1], 0xee));
  // 128-bit lanes: register q holds blocks 4q .. 4q + 3, one per lane.
  for (int q = 0; q < 4; ++q)
    m[q] = max_lanes<S>(_mm512_shuffle_i64x2(m[2 * q], m[2 * q + 1], 0x88), _mm512_shuffle_i64x2(m[2 * q], m[2 * q + 1], 0xdd));
  // 64-bit halves: register r, lane l holds block 8 r + l (low qword) and 8 r + 4 + l (high).
  for (int r = 0; r < 2; ++r)
    m[r] = max_lanes<S>(_mm512_unpacklo_epi64(m[2 * r], m[2 * r + 1]), _mm512_unpackhi_epi64(m[2 * r], m[2 * r + 1]));
  // Within each qword: its block's max in the low 16 (bf16) or 32 (float) bits.
  for (int r = 0; r < 2; ++r) {
    m[r] = max_lanes<S>(m[r], _mm512_srli_epi64(m[r], 32));
    if constexpr (kBf16) m[r] = max_lanes<S>(m[r], _mm512_srli_epi32(m[r], 16));
  }
  // Block j sits in qword 2 (j % 4) + (j / 4) % 2 of register j / 8: its low dword.
  const __m512i order = _mm512_set_epi32(30, 26, 22, 18, 28, 24, 20, 16, 14, 10, 6, 2, 12, 8, 4, 0);
  const __m512i r = _mm512_permutex2var_epi32(m[0], order, m[1]);
  return kBf16 ? _mm512_slli_epi32(r, 16) : r;
}

// One whole block's codes (`block` a power of two from 32), its inverse scale in every lane.
template <typename S>
FSDPN_X512 FSDPN_INLINE void nf4_encode_block(const S* x, int64_t block, __m512 inv, const Nf4Regs& tb, __m512i pack, uint8_t* c) {
  if (block == 32) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(c), _mm512_cvtepi32_epi8(nf4_group32(x, inv, tb)));
    return;
  }
  for (int64_t k = 0; k < block; k += 64) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + k / 2),
                        _mm512_castsi512_si256(_mm512_permutex2var_epi8(nf4_group32(x + k, inv, tb), pack, nf4_group32(x + k + 32, inv, tb))));
  }
}

// NF4 blocks as nf4_blocks_loop; whole blocks of 32 or more elements here, 32 at a time: the
// even and odd elements in separate registers, so that one lane holds both codes of a byte.
// Runs of 16 whole blocks get their amaxes, scales and inverse scales as vectors.
template <typename S>
FSDPN_X512 void nf4_blocks_x512(const void* src, int64_t n, int64_t len, int64_t n_blocks, int64_t block,
                                uint8_t* codes, uint8_t* scales) {
  const Nf4Buckets& t = nf4_buckets();
  if (!t.ok || block < 32) {
    nf4_blocks_avx512<S>(src, n, len, n_blocks, block, codes, scales);
    return;
  }
  const S* s = static_cast<const S*>(src);
  const Nf4Regs tb = nf4_regs(t);
  alignas(64) static constexpr uint8_t kPack[64] = {
      0,  4,  8,  12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60, 64, 68, 72, 76, 80, 84, 88, 92, 96, 100, 104, 108, 112, 116, 120, 124,
      0,  4,  8,  12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60, 64, 68, 72, 76, 80, 84, 88, 92, 96, 100, 104, 108, 112, 116, 120, 124};
  const __m512i pack = _mm512_load_si512(kPack);  // byte 4 k of a (k < 16), then of b
  // Whole blocks (every element in [0, n) and [0, len)), 16 at a time while 16 blocks fit in
  // 16 KiB (still in L1 for the encode); larger blocks amortize their own amax.
  const int64_t whole = block * static_cast<int64_t>(sizeof(S)) <= 1024
                            ? std::min<int64_t>(n_blocks, std::max<int64_t>(0, std::min(n, len)) / block)
                            : 0;
  int64_t b = 0;
  for (; b + 16 <= whole; b += 16) {
    const S* x = s + b * block;
    uint8_t* c = codes + b * block / 2;
    // nf4_scale of each amax: 1 for 0, the smallest normal below it, NaN for inf / NaN.
    const __m512i amax = nf4_amax16(x, block);
    const __mmask16 bad = _mm512_cmpge_epu32_mask(amax, _mm512_set1_epi32(0x7f800000));
    __m512i bits = _mm512_max_epu32(amax, _mm512_set1_epi32(0x00800000));
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(amax, _mm512_setzero_si512()), _mm512_set1_epi32(0x3f800000));
    bits = _mm512_mask_mov_epi32(bits, bad, _mm512_set1_epi32(static_cast<int>(kNaNBits)));
    _mm512_storeu_si512(scales + 4 * b, bits);
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_castsi512_ps(bits));
    for (int j = 0; j < 16; ++j) {
      if (bad >> j & 1) {  // a NaN or an infinity in the block: every v is NaN, code 0
        std::memset(c + j * block / 2, 0, static_cast<size_t>(block / 2));
        continue;
      }
      nf4_encode_block(x + j * block, block, _mm512_permutexvar_ps(_mm512_set1_epi32(j), inv), tb, pack, c + j * block / 2);
    }
  }
  for (; b < n_blocks; ++b) {
    const int64_t lo = b * block;
    const int64_t valid = std::max<int64_t>(0, std::min(std::min(block, len - lo), n - lo));
    if (valid != block) {
      nf4_blocks_loop(s + lo, n - lo, len - lo, 1, block, codes + lo / 2, scales + 4 * b);
      continue;
    }
    const S* x = s + lo;
    uint8_t* c = codes + lo / 2;
    uint32_t amax;
    if constexpr (std::is_same<S, bf16_t>::value) {
      __m512i m = _mm512_setzero_si512();
      for (int64_t k = 0; k < block; k += 32) m = _mm512_max_epu16(m, _mm512_and_si512(_mm512_loadu_si512(x + k), _mm512_set1_epi16(0x7fff)));
      amax = hmax_epu16(m) << 16;
    } else {
      __m512i m = _mm512_setzero_si512();
      for (int64_t k = 0; k < block; k += 16) m = _mm512_max_epu32(m, _mm512_and_si512(_mm512_loadu_si512(x + k), _mm512_set1_epi32(0x7fffffff)));
      amax = _mm512_reduce_max_epu32(m);
    }
    const float scale = nf4_scale(amax);
    std::memcpy(scales + 4 * b, &scale, 4);
    if (scale != scale) {  // a NaN or an infinity in the block: every v is NaN, code 0
      std::memset(c, 0, static_cast<size_t>(block / 2));
      continue;
    }
    nf4_encode_block(x, block, _mm512_set1_ps(1.0f / scale), tb, pack, c);
  }
}

// fp8 decode. Fast path where every product code * scale is 0 or a normal float: scale in
// [2^-117, 2^100] (the smallest nonzero code is 2^-9, the largest 448; 256 scale is exact).
// There code * scale = fp16(code's bits) * (256 scale) with one rounding, and VCVTNE2PS2BF16
// rounds to nearest even like store_value. NaN codes (0x7f, 0xff: 2 code = 0xfe in 8 bits)
// store the canonical NaN. Other scales (garbage bytes, tiny scales) take fp8_decode_avx512.
template <typename D>
FSDPN_X512 void fp8_decode_x512(const uint8_t* c, int64_t n, float scale, void* dst) {
  if (!(std::fabs(scale) >= 0x1p-117f && std::fabs(scale) <= 0x1p100f)) {
    fp8_decode_avx512<D>(c, n, scale, dst);
    return;
  }
  D* d = static_cast<D*>(dst);
  const __m512 sc = _mm512_set1_ps(scale * 256.0f);
  const __m512i bits = _mm512_set1_epi16(static_cast<short>(0xbf80));  // sign, exponent and mantissa of e4m3 in fp16
  const __m256i nan_code = _mm256_set1_epi8(static_cast<char>(0xfe));
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + i));
    const __mmask32 nan = _mm256_cmpeq_epi8_mask(_mm256_add_epi8(b, b), nan_code);
    const __m512i h = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(b), 7), bits);
    const __m512 v0 = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), sc);
    const __m512 v1 = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), sc);
    if constexpr (std::is_same<D, float>::value) {
      const __m512 q = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(kNaNBits)));
      _mm512_storeu_ps(d + i, _mm512_mask_mov_ps(v0, static_cast<__mmask16>(nan), q));
      _mm512_storeu_ps(d + i + 16, _mm512_mask_mov_ps(v1, static_cast<__mmask16>(nan >> 16), q));
    } else {
      const __m512i r = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(v1, v0));
      _mm512_storeu_si512(d + i, _mm512_mask_mov_epi16(r, nan, _mm512_set1_epi16(0x7fc0)));
    }
  }
  if (i < n) fp8_decode_avx512<D>(c + i, n - i, scale, d + i);
}

// NF4 decode, 32 elements (16 bytes) at a time: VPMULTISHIFTQB puts the high nibble of byte m
// in the low bits of lane 2m and the low nibble in lane 2m + 1 (of 8 bytes broadcast to every
// quadword), VPERMPS looks the values up. Fast path where every product is 0 or normal and
// finite: |scale| in [2^-122, max float] (the smallest nonzero |value| is 0.0796 > 2^-4).
template <typename D>
FSDPN_X512 void nf4_decode_x512(const uint8_t* codes, const uint8_t* scales, int64_t lo, int64_t hi,
                                int64_t block, void* dst) {
  alignas(64) float t[16];
  for (uint32_t k = 0; k < 16; ++k) t[k] = nf4_value(k);
  const __m512 table = _mm512_load_ps(t);
  const __m512i ctrl = _mm512_set_epi64(int64_t{56} << 32 | 60, int64_t{48} << 32 | 52, int64_t{40} << 32 | 44,
                                        int64_t{32} << 32 | 36, int64_t{24} << 32 | 28, int64_t{16} << 32 | 20,
                                        int64_t{8} << 32 | 12, int64_t{0} << 32 | 4);
  D* out = static_cast<D*>(dst);
  for (int64_t b0 = lo; b0 < hi; b0 += block) {
    float s;
    std::memcpy(&s, scales + 4 * (b0 / block), 4);
    const int64_t end = std::min(hi, b0 + block);
    D* d = out + (b0 - lo);
    if (!(std::fabs(s) >= 0x1p-122f && std::fabs(s) <= 3.4028234663852886e38f)) {
      nf4_decode_avx512(codes, scales, b0, end, block, d);
      continue;
    }
    const __m512 scale = _mm512_set1_ps(s);
    const uint8_t* c = codes + b0 / 2;
    const int64_t n = end - b0;
    int64_t k = 0;
    for (; k + 32 <= n; k += 32) {
      int64_t q0, q1;
      std::memcpy(&q0, c + k / 2, 8);
      std::memcpy(&q1, c + k / 2 + 8, 8);
      const __m512 v0 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_multishift_epi64_epi8(ctrl, _mm512_set1_epi64(q0)), table), scale);
      const __m512 v1 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_multishift_epi64_epi8(ctrl, _mm512_set1_epi64(q1)), table), scale);
      if constexpr (std::is_same<D, float>::value) {
        _mm512_storeu_ps(d + k, v0);
        _mm512_storeu_ps(d + k + 16, v1);
      } else {
        _mm512_storeu_si512(d + k, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(v1, v0)));
      }
    }
    for (; k < n; ++k) {
      const uint32_t byte = c[k / 2];
      d[k] = store_value<D>(nf4_value((k & 1) ? (byte & 15u) : (byte >> 4)) * s);
    }
  }
}
#endif

// --- one multiversioned entry point per dtype ----------------------------------------------------

struct SrcFns {
  uint32_t (*max_finite_abs)(const void*, int64_t);
  void (*fp8_encode)(const void*, int64_t, float, uint8_t*);
  // the same where |x / scale| < 464 for every finite x (a scale from the finite amax)
  void (*fp8_encode_bounded)(const void*, int64_t, float, uint8_t*);
  void (*nf4_blocks)(const void*, int64_t, int64_t, int64_t, int64_t, uint8_t*, uint8_t*);
  // fp8_rowwise over whole rows (src, row, rows, codes, scales), or null
  void (*fp8_rows)(const void*, int64_t, int64_t, uint8_t*, uint8_t*) = nullptr;
  // Largest |x| bits, inf and NaN included, and fp8_encode_bounded for finite x only: both set
  // (the AVX-512 VBMI/BF16 and AVX2 levels) or both null (then `abs_max_pass(..., any_abs)` is the
  // finite amax and quantize_task falls back to the encode with the fix-up, so a "finite" flag is
  // harmless)
  uint32_t (*max_abs)(const void*, int64_t) = nullptr;
  void (*fp8_encode_finite)(const void*, int64_t, float, uint8_t*) = nullptr;
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
      if (have_avx512x()) return {max_finite_abs_x512_float, fp8_encode_x512_fn<float, true>, fp8_encode_x512_fn<float, false>, nf4_blocks_x512<float>, fp8_rows_x512<float>,
                                  max_abs_x512<float>, fp8_encode_x512_fn<float, false, true>};
      if (have_avx512()) return {max_finite_abs_float, fp8_encode_avx512<float>, fp8_encode_avx512<float>, nf4_blocks_avx512<float>};
      if (have_avx2()) return {max_finite_abs_float, fp8_encode_avx2<float, false>, fp8_encode_avx2<float, true>,
                               have_avx2_with(kFma) ? nf4_blocks_avx2<float> : nf4_blocks_float, fp8_rows_avx2<float>,
                               max_abs_avx2<float>, fp8_encode_avx2<float, true, false>};
      return {max_finite_abs_float, fp8_encode_float, fp8_encode_float, nf4_blocks_float};
    case at::kBFloat16:
      if (have_avx512x()) return {max_finite_abs_x512_bf16, fp8_encode_x512_fn<bf16_t, true>, fp8_encode_x512_fn<bf16_t, false>, nf4_blocks_x512<bf16_t>, fp8_rows_x512<bf16_t>,
                                  max_abs_x512<bf16_t>, fp8_encode_x512_fn<bf16_t, false, true>};
      if (have_avx512()) return {max_finite_abs_bf16_t, fp8_encode_avx512<bf16_t>, fp8_encode_avx512<bf16_t>, nf4_blocks_avx512<bf16_t>};
      if (have_avx2()) return {max_finite_abs_bf16_t, fp8_encode_avx2<bf16_t, false>, fp8_encode_avx2<bf16_t, true>,
                               have_avx2_with(kFma) ? nf4_blocks_avx2<bf16_t> : nf4_blocks_bf16_t, fp8_rows_avx2<bf16_t>,
                               max_abs_avx2<bf16_t>, fp8_encode_avx2<bf16_t, true, false>};
      return {max_finite_abs_bf16_t, fp8_encode_bf16_t, fp8_encode_bf16_t, nf4_blocks_bf16_t};
#else
    case at::kFloat: return {max_finite_abs_float, fp8_encode_float, fp8_encode_float, nf4_blocks_float};
    case at::kBFloat16: return {max_finite_abs_bf16_t, fp8_encode_bf16_t, fp8_encode_bf16_t, nf4_blocks_bf16_t};
#endif
    default: return {max_finite_abs_f16_t, fp8_encode_f16_t, fp8_encode_f16_t, nf4_blocks_f16_t};
  }
}
DstFns dst_fns(at::ScalarType t) {
  switch (t) {
#if FSDPN_QUANT_X86
    case at::kFloat:
      if (have_avx512x()) return {fp8_decode_x512<float>, nf4_decode_x512<float>};
      if (have_avx512()) return {fp8_decode_avx512<float>, nf4_decode_avx512_float};
      if (have_avx2_with(kF16c)) return {fp8_decode_f16c<float>, nf4_decode_avx2_float};
      if (have_avx2()) return {fp8_decode_float, nf4_decode_avx2_float};
      return {fp8_decode_float, nf4_decode_float};
    case at::kBFloat16:
      if (have_avx512x()) return {fp8_decode_x512<bf16_t>, nf4_decode_x512<bf16_t>};
      if (have_avx512()) return {fp8_decode_avx512<bf16_t>, nf4_decode_avx512_bf16};
      if (have_avx2_with(kF16c)) return {fp8_decode_f16c<bf16_t>, nf4_decode_avx2_bf16};
      if (have_avx2()) return {fp8_decode_avx2_bf16, nf4_decode_avx2_bf16};
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

// The largest |x| of each parameter, as float bits, in one parallel pass: over the finite values,
// or with `any_abs` over all values (inf and NaN included) where the kernels have that pass.
std::vector<float> abs_max_pass(const std::vector<QuantParam>& params, bool any_abs) {
  std::vector<Task> tasks;
  for (size_t i = 0; i < params.size(); ++i) add_tasks(tasks, i, 0, params[i].numel, 64);
  std::vector<uint32_t> partial(tasks.size(), 0);
  const Task* first = tasks.data();
  run_tasks(tasks, [&](const Task& k) {
    const QuantParam& p = params[k.param];
    const SrcFns fns = src_fns(p.dtype);
    partial[&k - first] = (any_abs && fns.max_abs != nullptr ? fns.max_abs : fns.max_finite_abs)(elem_ptr(p, k.lo), k.hi - k.lo);
  });
  std::vector<uint32_t> bits(params.size(), 0);
  for (size_t t = 0; t < tasks.size(); ++t) bits[tasks[t].param] = std::max(bits[tasks[t].param], partial[t]);
  std::vector<float> out(params.size());
  for (size_t i = 0; i < params.size(); ++i) out[i] = bits_float(bits[i]);
  return out;
}

// amax over the finite values of each parameter. The cheaper pass over every |x| runs first:
// below inf, the parameter is finite (the common case); only the others get the finite pass.
// `finite` (optional): per parameter, whether that first pass found it finite.
std::vector<float> finite_amax(const std::vector<QuantParam>& params, std::vector<char>* finite = nullptr) {
  std::vector<float> a = abs_max_pass(params, /*any_abs=*/true);
  if (finite != nullptr) finite->assign(a.size(), 1);
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isfinite(a[i])) continue;
    if (finite != nullptr) (*finite)[i] = 0;
    a[i] = abs_max_pass({params[i]}, /*any_abs=*/false)[0];
  }
  return a;
}

void zero_gaps(uint8_t* seg, const SegmentLayout& l) {
  std::memset(seg + l.data_nbytes, 0, static_cast<size_t>(l.scale_offset - l.data_nbytes));
  const int64_t scales_end = l.scale_offset + 4 * l.n_scales;
  std::memset(seg + scales_end, 0, static_cast<size_t>(l.nbytes - scales_end));
}

// `finite`: fp8_tensorwise with the scale from this rank's data, whose shard has no inf or NaN.
void quantize_task(const QuantizePlan& plan, const Task& k, bool finite = false) {
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
  const bool bounded = plan.fmt == kFp8Rowwise || plan.amax == nullptr;  // scales from the data
  auto encode = [&](int64_t lo, int64_t hi, float scale) {
    const int64_t valid_hi = std::min(hi, p.numel);
    auto* fn = finite && fns.fp8_encode_finite != nullptr ? fns.fp8_encode_finite : bounded ? fns.fp8_encode_bounded : fns.fp8_encode;
    if (valid_hi > lo) fn(elem_ptr(p, lo), valid_hi - lo, 1.0f / scale, seg + lo);
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
  int64_t r0 = k.lo;  // a whole number of rows
  if (fns.fp8_rows != nullptr) {
    const int64_t end = std::min(k.hi, p.numel / row * row);  // the rows with every element valid
    if (end > r0) fns.fp8_rows(elem_ptr(p, r0), row, (end - r0) / row, seg + r0, scales + 4 * (r0 / row));
    r0 = std::max(r0, end);
  }
  for (; r0 < k.hi; r0 += row) {
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
  if (plan.fmt == kFp8Tensorwise && plan.amax == nullptr) {
    // One parameter at a time, its amax pass then its encode pass: a shard that fits in the
    // L2 cache is read from there the second time.
    for (size_t i = 0; i < plan.params.size(); ++i) {
      const QuantParam& p = plan.params[i];
      if (p.layout.nbytes == 0) continue;
      // A finite shard (the common case) needs no non-finite fix-up in its encode.
      std::vector<char> finite;
      const float scale = fp8_scale(finite_amax({p}, &finite)[0]);
      std::memcpy(plan.out + p.offset + p.layout.scale_offset, &scale, 4);
      zero_gaps(plan.out + p.offset, p.layout);
      std::vector<Task> tasks;
      add_tasks(tasks, i, 0, p.padded, task_unit(plan.fmt, p, plan.block));
      run_tasks(tasks, [&](const Task& k) { quantize_task(plan, k, finite[0] != 0); });
    }
    return;
  }
  if (plan.fmt == kFp8Tensorwise) {
    const std::vector<float> a(plan.amax, plan.amax + plan.params.size());
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

std::string quant_cpu_isa() {
#if FSDPN_QUANT_X86
  if (have_avx512x()) return "avx512-vbmi";
  if (have_avx512()) return "avx512";
  if (have_avx2()) return "avx2";
#else
  (void)isa_cap();
#endif
  return "portable";
}

}  // namespace quant
}  // namespace fsdp_native
