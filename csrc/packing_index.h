// Index arithmetic and element conversions shared by the CPU and CUDA packing kernels.
//
// Everything here is a pure function of integers (and bit patterns), compiled for the host
// and for the device, so the CPU kernels and tests exercise exactly the math the CUDA
// kernels run. A parameter of `numel` elements is sharded on dim 0 into world_size chunks
// of `padded` elements each (the last chunks may be partly or wholly padding).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FSDPN_HD __host__ __device__ __forceinline__
#elif defined(__GNUC__)
// The CPU element loops are compiled once per ISA (target_clones); GCC does not inline
// across target options on its own, and a helper left out of line runs as baseline code.
#define FSDPN_HD inline __attribute__((always_inline))
#else
#define FSDPN_HD inline
#endif

namespace fsdp_native {

// Number of real (non-padding) elements rank `rank` holds of a parameter.
FSDPN_HD int64_t shard_valid_numel(int64_t numel, int64_t padded, int64_t rank) {
  const int64_t start = rank * padded;
  if (start >= numel) return 0;
  const int64_t left = numel - start;
  return left < padded ? left : padded;
}

// Padded per-rank numel of a tensor whose dim 0 of size `dim0` is chunked
// over `world_size` ranks, each row holding `row_numel` elements.
FSDPN_HD int64_t padded_shard_numel(int64_t dim0, int64_t row_numel, int64_t world_size) {
  return ((dim0 + world_size - 1) / world_size) * row_numel;
}

// A unit of copy work: copy `n_copy` elements src -> dst, then zero `n_zero`
// elements of dst after them (padding). Elements, not bytes.
struct Segment {
  const void* src;
  void* dst;
  int64_t n_copy;
  int64_t n_zero;
};

FSDPN_HD int64_t segment_len(const Segment& s) { return s.n_copy + s.n_zero; }

// Given inclusive prefix sums `ends[i] = sum_{j<=i} len(j)`, the segment that
// holds flat element `idx` (0 <= idx < ends[n-1]). Binary search. Works on any
// indexable table (a pointer, or an array held in kernel parameters).
template <typename Ends>
FSDPN_HD int64_t find_segment(const Ends& ends, int64_t n, int64_t idx) {
  int64_t lo = 0, hi = n - 1;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (ends[mid] > idx) hi = mid; else lo = mid + 1;
  }
  return lo;
}

// The part of flat range [begin, end) that falls in a segment starting at flat element
// `seg_begin`, split into the elements to copy and the padding to zero, as offsets into
// the segment: copy [copy_lo, copy_hi), zero [zero_lo, zero_hi) (either may be empty).
struct SegmentPiece {
  int64_t copy_lo, copy_hi, zero_lo, zero_hi;
};

FSDPN_HD SegmentPiece segment_piece(const Segment& s, int64_t seg_begin, int64_t begin,
                                    int64_t end) {
  const int64_t len = segment_len(s);
  int64_t lo = begin - seg_begin, hi = end - seg_begin;
  lo = lo < 0 ? 0 : lo;
  hi = hi > len ? len : hi;
  SegmentPiece p;
  p.copy_lo = lo;
  p.copy_hi = hi < s.n_copy ? hi : s.n_copy;
  if (p.copy_hi < p.copy_lo) p.copy_hi = p.copy_lo;
  p.zero_lo = lo > s.n_copy ? lo : s.n_copy;
  p.zero_hi = hi;
  if (p.zero_hi < p.zero_lo) p.zero_hi = p.zero_lo;
  return p;
}

// --- tiles: the CUDA kernels' work decomposition --------------------------------------------
//
// A segment is cut into tiles, each done by one thread block. Stores are vectors of
// kVecBytes (16-byte `st.global.v4`); `vec_head` scalar elements come first so that the
// destination is 16-byte aligned after them, and every tile but the first starts on a
// vector boundary. A tile is at most `tile_elems` elements past the head (the first tile
// also takes the head). Loads are vectors too when the source is aligned at the same
// element (`src_vec_aligned`), else scalar into the vector that is stored.

constexpr int64_t kVecBytes = 16;

// Elements of `es` bytes before `dst` reaches a kVecBytes boundary; -1 when `dst` is not
// aligned to its element size (then no element boundary is ever 16-byte aligned).
FSDPN_HD int64_t vec_head(uintptr_t dst, int64_t es) {
  if (dst % static_cast<uintptr_t>(es) != 0) return -1;
  const int64_t mis = static_cast<int64_t>(dst % static_cast<uintptr_t>(kVecBytes));
  return ((kVecBytes - mis) % kVecBytes) / es;
}

// Bytes a vector load of `vec_elems` source elements needs to be aligned to (16-byte
// loads for 16 or more bytes, else one load of the whole vector).
FSDPN_HD int64_t src_vec_align(int64_t vec_elems, int64_t src_es) {
  const int64_t bytes = vec_elems * src_es;
  return bytes < kVecBytes ? bytes : kVecBytes;
}

// Whether source element `first` (the first vector's) is aligned for vector loads.
FSDPN_HD bool src_vec_aligned(uintptr_t src, int64_t src_es, int64_t first, int64_t vec_elems) {
  const uintptr_t at = src + static_cast<uintptr_t>(first * src_es);
  return at % static_cast<uintptr_t>(src_vec_align(vec_elems, src_es)) == 0;
}

// Tiles of a segment of `len` elements with `head` leading scalar elements (head < 0:
// no vectors at all, the segment is cut at multiples of tile_elems). At least one.
FSDPN_HD int64_t tile_count(int64_t len, int64_t head, int64_t tile_elems) {
  const int64_t h = head < 0 ? 0 : head;
  if (len <= h) return 1;
  const int64_t n = (len - h + tile_elems - 1) / tile_elems;
  return n < 1 ? 1 : n;
}

// Elements [lo, hi) of tile `t`: the head joins tile 0; the other tiles start on vector
// boundaries (head + t * tile_elems).
struct TileSpan {
  int64_t lo, hi;
};

FSDPN_HD TileSpan tile_span(int64_t len, int64_t head, int64_t tile_elems, int64_t t) {
  const int64_t h = head < 0 ? 0 : (head < len ? head : len);
  TileSpan s;
  s.lo = t == 0 ? 0 : h + t * tile_elems;
  s.hi = h + (t + 1) * tile_elems;
  if (s.hi > len) s.hi = len;
  return s;
}

// The vector part [vec_lo, vec_hi) of a tile: whole vectors of `vec_elems` elements
// starting at max(lo, head); the elements of [lo, vec_lo) and [vec_hi, hi) are scalar.
struct TileVectors {
  int64_t vec_lo, vec_hi;
};

FSDPN_HD TileVectors tile_vectors(TileSpan span, int64_t head, int64_t vec_elems) {
  TileVectors v;
  if (head < 0) {  // misaligned destination: all scalar
    v.vec_lo = v.vec_hi = span.hi;
    return v;
  }
  v.vec_lo = span.lo > head ? span.lo : (head < span.hi ? head : span.hi);
  v.vec_hi = v.vec_lo + (span.hi - v.vec_lo) / vec_elems * vec_elems;
  return v;
}

// --- bit-exact float conversions ----------------------------------------------------------
//
// Storage types: bfloat16 and float16 travel as raw 16-bit words and convert by bit math,
// the same on the host and the device. Rounding is to nearest even; the NaN encodings are
// those of torch's CPU casts (`tensor.to(dtype)`, whose AVX2 / AVX-512 kernels run on every
// x86-64 CPU torch supports with vector units), so the CUDA kernels equal the CPU kernels
// bit for bit, NaNs included:
//  * float -> bfloat16: every NaN becomes 0xffff (at::vec's cvtfp32_bf16 blends that in);
//  * float16 -> bfloat16 (a plain cast): every NaN becomes 0x7fc0 (torch's CPU copy kernel
//    does it element by element with c10's scalar rounding);
//  * float -> float16: NaNs keep sign and top 10 payload bits, quiet bit set (F16C's
//    vcvtps2ph); float16 -> float: payload kept, quiet bit set (vcvtph2ps).
// (Torch forced to ATEN_CPU_CAPABILITY=default writes bfloat16 NaNs as 0x7fc0 instead.)
struct bf16_t { uint16_t x; };
struct f16_t { uint16_t x; };

FSDPN_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

FSDPN_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

FSDPN_HD bool is_nan_bits(uint32_t u) { return (u & 0x7fffffffu) > 0x7f800000u; }

// float bits -> bfloat16 bits, round to nearest even; a NaN becomes `nan`.
FSDPN_HD uint16_t float_bits_to_bf16(uint32_t u, uint16_t nan) {
  const uint16_t rounded = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  return is_nan_bits(u) ? nan : rounded;
}

FSDPN_HD uint32_t bf16_to_float_bits(uint16_t h) { return static_cast<uint32_t>(h) << 16; }

// float16 <-> float by bit math, the algorithm of c10::detail::fp16_ieee_{to,from}_fp32_value
// (FP16 library, M. Dukhan) restated branch-free so that it vectorises on the CPU, with
// infinities and NaNs built from their bits (a device multiply would not keep a NaN payload).
FSDPN_HD float f16_bits_to_float(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  // Normal: rebias the exponent by 0xe0 then scale by 2^-112 (exact).
  const float normalized = bits_float((two_w >> 4) + (0xe0u << 23)) * bits_float(15u << 23);
  // Zero and subnormal: mantissa * 2^-24, built as (0.5 + m * 2^-24) - 0.5.
  const float denormalized = bits_float((two_w >> 17) | (126u << 23)) - 0.5f;
  // Infinity and NaN: exponent all ones, payload kept, a NaN's quiet bit set.
  const uint32_t mant = static_cast<uint32_t>(h) & 0x3ffu;
  const uint32_t special = 0x7f800000u | (mant << 13) | (mant != 0u ? 0x00400000u : 0u);
  const uint32_t is_denormal = 0u - static_cast<uint32_t>(two_w < (1u << 27));   // all ones or 0
  const uint32_t is_special = 0u - static_cast<uint32_t>(two_w >= 0xf8000000u);  // exp 0x1f
  const uint32_t finite =
      (is_denormal & float_bits(denormalized)) | (~is_denormal & float_bits(normalized));
  return bits_float(sign | (is_special & special) | (~is_special & finite));
}

FSDPN_HD uint16_t float_to_f16_bits(float f) {
  const uint32_t w = float_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  // Scale to 2^112 then 2^-110 (both exact but for overflow to inf), and the add below
  // rounds the mantissa to 10 bits (nearest even) at the right exponent, subnormals included.
  float base = (bits_float(w & 0x7fffffffu) * bits_float(239u << 23)) * bits_float(17u << 23);
  const uint32_t e = shl1_w & 0xff000000u;
  const uint32_t bias = e > 0x71000000u ? e : 0x71000000u;
  base = bits_float((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = float_bits(base);
  const uint32_t nonsign = ((bits >> 13) & 0x7c00u) + (bits & 0x0fffu);
  const uint32_t nan = 0x7e00u | ((w >> 13) & 0x3ffu);
  const uint32_t is_nan = 0u - static_cast<uint32_t>(shl1_w > 0xff000000u);  // all ones or 0
  return static_cast<uint16_t>((sign >> 16) | (is_nan & nan) | (~is_nan & nonsign));
}

FSDPN_HD float to_float(float v) { return v; }
FSDPN_HD float to_float(bf16_t v) { return bits_float(bf16_to_float_bits(v.x)); }
FSDPN_HD float to_float(f16_t v) { return f16_bits_to_float(v.x); }

template <typename T> FSDPN_HD T from_float(float f);
template <> FSDPN_HD float from_float<float>(float f) { return f; }
template <> FSDPN_HD bf16_t from_float<bf16_t>(float f) {
  return bf16_t{float_bits_to_bf16(float_bits(f), 0xffffu)};
}
template <> FSDPN_HD f16_t from_float<f16_t>(float f) { return f16_t{float_to_f16_bits(f)}; }

// A plain cast (no arithmetic): through float, but float16 -> bfloat16 NaNs as torch's CPU
// copy writes them.
template <typename S, typename D>
FSDPN_HD D convert(S v) { return from_float<D>(to_float(v)); }
template <>
FSDPN_HD bf16_t convert<f16_t, bf16_t>(f16_t v) {
  return bf16_t{float_bits_to_bf16(float_bits(to_float(v)), 0x7fc0u)};
}

}  // namespace fsdp_native
