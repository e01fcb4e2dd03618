// Element math and byte layout of fsdp_native's quantized all-gather formats, shared by the
// CPU kernels (csrc/cpu/quant_cpu.cpp) and any CUDA kernels: pure functions of integers and
// bit patterns, compiled for the host and the device. The Python reference
// (fsdp_native/_quant_ref.py) and the Triton kernels (kernels/quant.py) restate exactly this
// math; the three agree bit for bit (tests/test_quant_kernels.py).
//
// Formats (one per call, for every parameter of a unit):
//  * kFp8Tensorwise: e4m3fn codes, one fp32 scale per parameter shard;
//  * kFp8Rowwise:    e4m3fn codes, one fp32 scale per row (dim-0 slice) of the shard;
//  * kNf4:           4-bit NF4 codes, two per byte (first element in the high nibble), one
//                    fp32 absmax scale per block of `block` elements of the flat shard.
//
// Layout of one parameter's segment of `padded` elements (bytes):
//   [codes: data_nbytes][zeros to a 4-byte boundary][fp32 scales: 4 * n_scales]
//   [zeros to a 16-byte boundary]
// so every segment, and every rank's chunk (their concatenation), is a multiple of 16 bytes.
// A parameter with no elements takes no bytes.
#pragma once

#include <cstdint>

#include "packing_index.h"  // FSDPN_HD, float_bits / bits_float, bf16 / f16 conversions

namespace fsdp_native {
namespace quant {

enum Format : int { kFp8Tensorwise = 0, kFp8Rowwise = 1, kNf4 = 2 };

constexpr float kE4M3Max = 448.0f;
// Smallest fp8 scale: 2^-126 (the smallest normal float). An amax below 448 * 2^-126 would
// give a subnormal or zero scale (x / 0 = inf); with this floor x / scale stays within 448.
constexpr float kMinFp8Scale = 0x1p-126f;
constexpr uint8_t kE4M3NaN = 0x7f;
constexpr uint32_t kNaNBits = 0x7fc00000u;  // the NaN every format dequantizes to

FSDPN_HD int64_t align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

struct SegmentLayout {
  int64_t data_nbytes;   // codes
  int64_t scale_offset;  // bytes from the segment start to the first fp32 scale
  int64_t n_scales;
  int64_t nbytes;        // the whole segment, a multiple of 16
};

// `row_numel` matters for kFp8Rowwise only (padded must be a multiple of it), `block` for
// kNf4 only. Callers validate those first.
FSDPN_HD SegmentLayout segment_layout(int fmt, int64_t padded, int64_t row_numel, int64_t block) {
  SegmentLayout l{0, 0, 0, 0};
  if (padded <= 0) return l;
  if (fmt == kNf4) {
    l.data_nbytes = (padded + 1) / 2;
    l.n_scales = (padded + block - 1) / block;
  } else {
    l.data_nbytes = padded;
    l.n_scales = fmt == kFp8Rowwise ? padded / row_numel : 1;
  }
  l.scale_offset = align_up(l.data_nbytes, 4);
  l.nbytes = align_up(l.scale_offset + 4 * l.n_scales, 16);
  return l;
}

// --- helpers on float bits ------------------------------------------------------------------

// Selects written as masks, not `?:`: GCC's vectoriser gives up on some selects feeding
// reductions or conversions ("control flow in loop"), and masks cost nothing on the device.
FSDPN_HD uint32_t mask_if(bool c) { return 0u - static_cast<uint32_t>(c); }
FSDPN_HD uint32_t select_u32(bool c, uint32_t a, uint32_t b) {
  const uint32_t m = mask_if(c);
  return (a & m) | (b & ~m);
}

// |x| as bits when x is finite, else 0: a max over these (as integers: non-negative floats
// order like their bits) is the amax over the finite values.
FSDPN_HD uint32_t finite_abs_bits(uint32_t u) {
  const uint32_t a = u & 0x7fffffffu;
  return a & mask_if(a < 0x7f800000u);
}

FSDPN_HD bool is_finite_bits(uint32_t u) { return (u & 0x7fffffffu) < 0x7f800000u; }

// --- fp8 e4m3fn -------------------------------------------------------------------------------
//
// Scale: amax / 448 (fp32 division, nearest even) where amax is the largest |x| over the
// finite values of the shard (tensorwise) or row (rowwise); amax 0 (also: no finite value,
// or an amax argument that is negative, NaN or inf) gives scale 1; the scale is at least
// 2^-126. Code: x * (1 / scale) (the reciprocal by one fp32 division, then one fp32 multiply
// per element: a division per element costs the CPU kernels a third of their time) clamped to
// [-448, 448], rounded to e4m3fn nearest even (subnormals included). Non-finite x (NaN, +inf, -inf) encode as the
// e4m3fn NaN 0x7f: e4m3fn has no infinity, and saturating an infinite weight to a finite value
// would hide a diverged parameter; they are left out of the amax, so one bad element does
// not zero the rest of its tensor or row. Dequantize: float(code) * scale (one fp32 rounding),
// then cast to the output dtype; NaN codes give NaN.

FSDPN_HD float fp8_scale(float amax) {
  if (!(amax > 0.0f) || !(amax <= 3.4028234663852886e38f)) return 1.0f;
  const float s = amax / kE4M3Max;
  return s < kMinFp8Scale ? kMinFp8Scale : s;
}

// e4m3fn bits of a finite `q` with |q| <= 448, nearest even.
FSDPN_HD uint8_t e4m3_from_float(float q) {
  const uint32_t u = float_bits(q);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7fffffffu;
  // Normal (|q| >= 2^-6): rebias the exponent (127 -> 7) and round 20 mantissa bits off.
  const uint32_t normal = (a - (120u << 23) + 0x7ffffu + ((a >> 20) & 1u)) >> 20;
  // Subnormal: in |q| + 2^14 the float's ulp is 2^-9, the e4m3 subnormal step, so the add
  // rounds |q| to a multiple of it and the low bits are that multiple (8 -> 2^-6, code 0x08).
  const uint32_t sub = float_bits(bits_float(a) + bits_float(141u << 23)) - (141u << 23);
  return static_cast<uint8_t>(select_u32(a < 0x3c800000u, sub, normal) | sign);
}

// `inv_scale`: 1.0f / scale.
FSDPN_HD uint8_t fp8_encode(float x, float inv_scale) {
  const float q = x * inv_scale;
  // Clamped by mask selects: with `?:` GCC does not vectorise the CPU loops ("control flow in
  // loop"; the AVX2 and baseline clones ran scalar). NaN q (non-finite x) is replaced below.
  const float hi = bits_float(select_u32(q > kE4M3Max, float_bits(kE4M3Max), float_bits(q)));
  const float c = bits_float(select_u32(hi < -kE4M3Max, float_bits(-kE4M3Max), float_bits(hi)));
  return static_cast<uint8_t>(select_u32(is_finite_bits(float_bits(x)), e4m3_from_float(c), kE4M3NaN));
}

// The value of an e4m3fn code (exact in fp32); 0x7f and 0xff give NaN.
FSDPN_HD float e4m3_to_float(uint32_t b) {
  const uint32_t sign = (b & 0x80u) << 24;
  const uint32_t e = (b >> 3) & 0xfu, m = b & 7u;
  const uint32_t sub = float_bits(static_cast<float>(static_cast<int32_t>(m)) * 0x1p-9f);
  const uint32_t normal = ((e + 120u) << 23) | (m << 20);
  const uint32_t bits = select_u32(e == 0u, sub, normal) | sign;
  return bits_float(select_u32((b & 0x7fu) == 0x7fu, kNaNBits, bits));
}

// --- NF4 ----------------------------------------------------------------------------------
//
// The 16 NF4 values (QLoRA's NormalFloat4: quantiles of N(0, 1) scaled to [-1, 1], with an
// exact 0), as fp32. Scale of a block: the largest |x| of the block (fp32; 1 when it is 0;
// at least 2^-126, so that 1 / scale is finite). A block holding a NaN or an infinity gets a
// NaN scale, so the whole block dequantizes to NaN (NF4 has no code for them; other blocks
// are untouched). Code of x: v = x * (1 / scale) (one fp32 division per block, one fp32
// multiply per element), then the number of midpoints below v: the midpoints are the fp32
// values (t[k] + t[k+1]) * 0.5f, and a v equal to a midpoint takes the lower code. (NaN v:
// code 0.) Elements past the shard and the padding of the last byte encode as 0 would.
// Dequantize: t[code] * scale (one fp32 rounding), then cast to the output dtype.

FSDPN_HD float nf4_value(uint32_t code) {
  constexpr float t[16] = {
      -0x1p+0f,       -0x1.647362p-1f, -0x1.0cd66p-1f,  -0x1.94654p-2f,
      -0x1.23449ap-2f, -0x1.7a6a7ep-3f, -0x1.74f0e2p-4f, 0.0f,
      0x1.45f5fep-4f,  0x1.4995c6p-3f,  0x1.f809bap-3f,  0x1.5a0674p-2f,
      0x1.c3497p-2f,   0x1.200f56p-1f,  0x1.722766p-1f,  0x1p+0f};
  return t[code & 15u];
}

FSDPN_HD uint32_t nf4_code(float v) {
  return static_cast<uint32_t>(v > -0x1.b239bp-1f) + static_cast<uint32_t>(v > -0x1.38a4ep-1f) +
         static_cast<uint32_t>(v > -0x1.d709p-2f) + static_cast<uint32_t>(v > -0x1.5bd4ecp-2f) +
         static_cast<uint32_t>(v > -0x1.e079d8p-3f) + static_cast<uint32_t>(v > -0x1.1a7178p-3f) +
         static_cast<uint32_t>(v > -0x1.74f0e2p-5f) + static_cast<uint32_t>(v > 0x1.45f5fep-5f) +
         static_cast<uint32_t>(v > 0x1.ec90c4p-4f) + static_cast<uint32_t>(v > 0x1.a0cfcp-3f) +
         static_cast<uint32_t>(v > 0x1.2b05a8p-2f) + static_cast<uint32_t>(v > 0x1.8ea7f2p-2f) +
         static_cast<uint32_t>(v > 0x1.00da08p-1f) + static_cast<uint32_t>(v > 0x1.491b5ep-1f) +
         static_cast<uint32_t>(v > 0x1.b913b4p-1f);
}

// Block scale from the largest |x| bits of the block, all values included (NaN, inf).
FSDPN_HD float nf4_scale(uint32_t max_abs_bits) {
  if (max_abs_bits >= 0x7f800000u) return bits_float(kNaNBits);
  if (max_abs_bits == 0u) return 1.0f;
  return bits_float(max_abs_bits < 0x00800000u ? 0x00800000u : max_abs_bits);
}

// --- output stores ----------------------------------------------------------------------------
//
// Dequantized values are written with one NaN per dtype (fp32 0x7fc00000, bf16 0x7fc0, f16
// 0x7e00) whatever NaN the arithmetic produced, so every implementation writes the same bits.

template <typename D> FSDPN_HD D store_value(float v);
template <> FSDPN_HD float store_value<float>(float v) {
  const uint32_t u = float_bits(v);
  return bits_float(select_u32(is_nan_bits(u), kNaNBits, u));
}
template <> FSDPN_HD bf16_t store_value<bf16_t>(float v) {
  const uint32_t u = float_bits(v);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return bf16_t{static_cast<uint16_t>(select_u32(is_nan_bits(u), 0x7fc0u, rounded))};
}
template <> FSDPN_HD f16_t store_value<f16_t>(float v) {
  return f16_t{static_cast<uint16_t>(select_u32(is_nan_bits(float_bits(v)), 0x7e00u, float_to_f16_bits(v)))};
}

}  // namespace quant
}  // namespace fsdp_native
