// CUDA kernels of the packing ops. The host planning (csrc/plan.cpp) is shared with
// the CPU kernels; this file only executes a CopyPlan on the current CUDA stream.
//
// Per plan: the segment tables of every dtype group (segments + inclusive prefix
// `ends`) are packed into one pinned host buffer and uploaded with one non_blocking
// H2D copy on the current stream. Then one kernel launch per group: each block owns a
// contiguous chunk of the group's flat element range, finds its first segment once
// with the shared `find_segment`, and walks the segments overlapping the chunk with
// its threads striding over elements (coalesced). Plain copies (same dtype, kCopy)
// are rewritten on the host into the widest word (16/8/4/2/1 bytes) that divides
// every address and length of the group, so they move 16-byte words when aligned.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "../plan.h"

namespace fsdp_native {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kItemsPerThread = 8;
constexpr int64_t kChunk = kThreads * kItemsPerThread;  // flat elements per block iteration
constexpr int64_t kMaxBlocks = int64_t{1} << 30;

// Storage types: bf16 and fp16 travel as raw 16-bit words; conversions are bit math
// (bf16: the shared packing_index.h functions, bit-exact with the CPU kernels).
struct bf16_w { uint16_t x; };
struct f16_w { uint16_t x; };

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(bf16_w v) { return __uint_as_float(bf16_to_float_bits(v.x)); }
__device__ __forceinline__ float to_float(f16_w v) { return __half2float(__ushort_as_half(v.x)); }

template <typename T> __device__ __forceinline__ T from_float(float f);
template <> __device__ __forceinline__ float from_float<float>(float f) { return f; }
template <> __device__ __forceinline__ bf16_w from_float<bf16_w>(float f) {
  return bf16_w{float_bits_to_bf16(__float_as_uint(f))};
}
template <> __device__ __forceinline__ f16_w from_float<f16_w>(float f) {
  return f16_w{__half_as_ushort(__float2half_rn(f))};
}

// Element ops. Explicit _rn intrinsics keep nvcc from contracting into FMAs, so the
// arithmetic rounds exactly like the CPU loops (dst + src * scale, two roundings).
template <typename S, typename D, Mode M>
struct CastOp {
  float scale;
  __device__ __forceinline__ void copy(const void* src, void* dst, int64_t k) const {
    const float s = to_float(static_cast<const S*>(src)[k]);
    D* d = static_cast<D*>(dst) + k;
    if constexpr (M == Mode::kCopy) {
      *d = from_float<D>(s);
    } else if constexpr (M == Mode::kScale) {
      *d = from_float<D>(__fmul_rn(s, scale));
    } else {
      *d = from_float<D>(__fadd_rn(to_float(*d), __fmul_rn(s, scale)));
    }
  }
  __device__ __forceinline__ void zero(void* dst, int64_t k) const {
    static_cast<D*>(dst)[k] = D{};
  }
};

struct alignas(16) w16 { uint64_t a, b; };

template <typename W>
struct WordOp {
  __device__ __forceinline__ void copy(const void* src, void* dst, int64_t k) const {
    static_cast<W*>(dst)[k] = static_cast<const W*>(src)[k];
  }
  __device__ __forceinline__ void zero(void* dst, int64_t k) const { static_cast<W*>(dst)[k] = W{}; }
};

template <typename Op>
__global__ void __launch_bounds__(kThreads)
    packing_kernel(const Segment* __restrict__ segs, const int64_t* __restrict__ ends, int64_t n_segs,
                   int64_t total, Op op) {
  __shared__ int64_t first_seg;
  for (int64_t begin = static_cast<int64_t>(blockIdx.x) * kChunk; begin < total;
       begin += static_cast<int64_t>(gridDim.x) * kChunk) {
    const int64_t end = begin + kChunk < total ? begin + kChunk : total;
    if (threadIdx.x == 0) first_seg = find_segment(ends, n_segs, begin);
    __syncthreads();
    int64_t s = first_seg;
    __syncthreads();  // everyone has read first_seg before the next iteration rewrites it
    for (int64_t idx = begin; idx < end; ++s) {
      const Segment seg = segs[s];
      const int64_t seg_end = ends[s];
      const int64_t seg_begin = seg_end - segment_len(seg);
      const int64_t hi = seg_end < end ? seg_end : end;
      for (int64_t i = idx + threadIdx.x; i < hi; i += kThreads) {
        const int64_t k = i - seg_begin;
        if (k < seg.n_copy) op.copy(seg.src, seg.dst, k);
        else op.zero(seg.dst, k);
      }
      idx = hi;
    }
  }
}

template <typename Op>
void launch(const Segment* segs, const int64_t* ends, int64_t n_segs, int64_t total, Op op,
            cudaStream_t stream) {
  const int64_t blocks = std::min((total + kChunk - 1) / kChunk, kMaxBlocks);
  packing_kernel<Op><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(segs, ends, n_segs,
                                                                              total, op);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

int float_index(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    default: return -1;
  }
}

template <typename S, typename D>
void launch_cast(Mode mode, float scale, const Segment* segs, const int64_t* ends, int64_t n,
                 int64_t total, cudaStream_t stream) {
  switch (mode) {
    case Mode::kCopy: return launch(segs, ends, n, total, CastOp<S, D, Mode::kCopy>{scale}, stream);
    case Mode::kScale: return launch(segs, ends, n, total, CastOp<S, D, Mode::kScale>{scale}, stream);
    case Mode::kAccumulate:
      return launch(segs, ends, n, total, CastOp<S, D, Mode::kAccumulate>{scale}, stream);
  }
}

template <typename S>
void launch_cast_src(int di, Mode mode, float scale, const Segment* segs, const int64_t* ends,
                     int64_t n, int64_t total, cudaStream_t stream) {
  switch (di) {
    case 0: return launch_cast<S, float>(mode, scale, segs, ends, n, total, stream);
    case 1: return launch_cast<S, bf16_w>(mode, scale, segs, ends, n, total, stream);
    default: return launch_cast<S, f16_w>(mode, scale, segs, ends, n, total, stream);
  }
}

// A group made ready for the device: segments in the unit the kernel indexes
// (elements, or words for plain copies) and their inclusive prefix ends.
struct DeviceGroup {
  std::vector<Segment> segs;
  std::vector<int64_t> ends;
  int64_t total = 0;
  bool plain = false;
  int64_t word = 0;     // plain: bytes per word
  int si = -1, di = -1;  // cast: float_index of src / dst
  size_t offset = 0;    // byte offset of this group's table in the upload buffer
};

DeviceGroup prepare(const CopyGroup& g, Mode mode) {
  DeviceGroup d;
  d.segs = g.segments;
  d.plain = g.src_dtype == g.dst_dtype && mode == Mode::kCopy;
  if (d.plain) {
    // Widest power-of-two word dividing every address and byte length of the group.
    const int64_t es = c10::elementSize(g.src_dtype);
    uint64_t bits = 16;
    for (const auto& s : d.segs) {
      bits |= reinterpret_cast<uintptr_t>(s.src) | reinterpret_cast<uintptr_t>(s.dst) |
              static_cast<uint64_t>(s.n_copy * es) | static_cast<uint64_t>(s.n_zero * es);
    }
    d.word = static_cast<int64_t>(bits & (~bits + 1));  // lowest set bit, <= 16
    for (auto& s : d.segs) {
      s.n_copy = s.n_copy * es / d.word;
      s.n_zero = s.n_zero * es / d.word;
    }
  } else {
    d.si = float_index(g.src_dtype);
    d.di = float_index(g.dst_dtype);
    TORCH_INTERNAL_ASSERT(d.si >= 0 && d.di >= 0, "fsdp_native: no CUDA kernel for ", g.src_dtype,
                          " -> ", g.dst_dtype);
  }
  d.ends.resize(d.segs.size());
  for (size_t i = 0; i < d.segs.size(); ++i) d.ends[i] = (d.total += segment_len(d.segs[i]));
  return d;
}

void launch_group(const DeviceGroup& g, const char* dev_base, Mode mode, float scale,
                  cudaStream_t stream) {
  const auto* segs = reinterpret_cast<const Segment*>(dev_base + g.offset);
  const auto* ends = reinterpret_cast<const int64_t*>(dev_base + g.offset + g.segs.size() * sizeof(Segment));
  const int64_t n = static_cast<int64_t>(g.segs.size());
  if (g.plain) {
    switch (g.word) {
      case 16: return launch(segs, ends, n, g.total, WordOp<w16>{}, stream);
      case 8: return launch(segs, ends, n, g.total, WordOp<uint64_t>{}, stream);
      case 4: return launch(segs, ends, n, g.total, WordOp<uint32_t>{}, stream);
      case 2: return launch(segs, ends, n, g.total, WordOp<uint16_t>{}, stream);
      default: return launch(segs, ends, n, g.total, WordOp<uint8_t>{}, stream);
    }
  }
  switch (g.si) {
    case 0: return launch_cast_src<float>(g.di, mode, scale, segs, ends, n, g.total, stream);
    case 1: return launch_cast_src<bf16_w>(g.di, mode, scale, segs, ends, n, g.total, stream);
    default: return launch_cast_src<f16_w>(g.di, mode, scale, segs, ends, n, g.total, stream);
  }
}

void all_gather_copy_in_cuda(at::TensorList shards, at::IntArrayRef padded_numels,
                             const at::Tensor& out) {
  run_plan_cuda(plan_all_gather_copy_in(shards, padded_numels, out));
}
void all_gather_copy_out_cuda(const at::Tensor& all_gather_output, at::IntArrayRef padded_numels,
                              int64_t world_size, at::TensorList outs) {
  run_plan_cuda(plan_all_gather_copy_out(all_gather_output, padded_numels, world_size, outs));
}
void reduce_scatter_copy_in_cuda(at::TensorList grads, at::IntArrayRef padded_numels,
                                 int64_t world_size, const at::Tensor& out) {
  run_plan_cuda(plan_reduce_scatter_copy_in(grads, padded_numels, world_size, out));
}
void reduce_scatter_copy_out_cuda(const at::Tensor& shard, at::IntArrayRef padded_numels,
                                  double divide_factor, bool accumulate, at::TensorList grads) {
  run_plan_cuda(
      plan_reduce_scatter_copy_out(shard, padded_numels, divide_factor, accumulate, grads));
}

}  // namespace

void run_plan_cuda(const CopyPlan& plan) {
  if (plan.groups.empty()) return;
  TORCH_INTERNAL_ASSERT(plan.device.is_cuda(), "fsdp_native: run_plan_cuda on ", plan.device);
  const c10::cuda::CUDAGuard guard(plan.device);

  std::vector<DeviceGroup> groups;
  groups.reserve(plan.groups.size());
  size_t bytes = 0;
  for (const auto& g : plan.groups) {
    groups.push_back(prepare(g, plan.mode));
    auto& d = groups.back();
    if (d.total == 0) {
      groups.pop_back();
      continue;
    }
    d.offset = bytes;
    bytes += d.segs.size() * (sizeof(Segment) + sizeof(int64_t));  // both 8-byte aligned
  }
  if (groups.empty()) return;

  // One pinned staging buffer and one H2D copy on the current stream. The caching host
  // allocator records the copy's stream event, so freeing `host` at scope exit is safe;
  // `dev` is freed to the caching device allocator in this stream's order, after the kernels.
  const at::Tensor host =
      at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  char* h = static_cast<char*>(host.data_ptr());
  for (const auto& d : groups) {
    std::memcpy(h + d.offset, d.segs.data(), d.segs.size() * sizeof(Segment));
    std::memcpy(h + d.offset + d.segs.size() * sizeof(Segment), d.ends.data(),
                d.ends.size() * sizeof(int64_t));
  }
  const at::Tensor dev =
      at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte).device(plan.device));
  dev.copy_(host, /*non_blocking=*/true);

  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(plan.device.index()).stream();
  const char* base = static_cast<const char*>(dev.const_data_ptr());
  const float scale = static_cast<float>(plan.scale);
  for (const auto& d : groups) launch_group(d, base, plan.mode, scale, stream);
}

TORCH_LIBRARY_IMPL(fsdp_native, CUDA, m) {
  m.impl("all_gather_copy_in", &all_gather_copy_in_cuda);
  m.impl("all_gather_copy_out", &all_gather_copy_out_cuda);
  m.impl("reduce_scatter_copy_in", &reduce_scatter_copy_in_cuda);
  m.impl("reduce_scatter_copy_out", &reduce_scatter_copy_out_cuda);
}

}  // namespace fsdp_native
