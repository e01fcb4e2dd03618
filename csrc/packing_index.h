// Index arithmetic shared by the CPU and CUDA packing kernels.
//
// Everything here is a pure function of integers so the CPU tests exercise
// exactly the math the CUDA kernels run. A parameter of `numel` elements is
// sharded on dim 0 into world_size chunks of `padded` elements each (the last
// chunks may be partly or wholly padding).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FSDPN_HD __host__ __device__ __forceinline__
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
// holds flat element `idx` (0 <= idx < ends[n-1]). Binary search.
FSDPN_HD int64_t find_segment(const int64_t* ends, int64_t n, int64_t idx) {
  int64_t lo = 0, hi = n - 1;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (ends[mid] > idx) hi = mid; else lo = mid + 1;
  }
  return lo;
}

// --- bit-exact float conversions (round to nearest even, NaN kept quiet) ---

FSDPN_HD uint16_t float_bits_to_bf16(uint32_t u) {
  const bool is_nan = (u & 0x7fffffffu) > 0x7f800000u;
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return is_nan ? static_cast<uint16_t>((u >> 16) | 0x40u) : static_cast<uint16_t>(rounded);
}

FSDPN_HD uint32_t bf16_to_float_bits(uint16_t h) { return static_cast<uint32_t>(h) << 16; }

}  // namespace fsdp_native
