// CUDA kernels of the packing ops. The host planning (csrc/plan.cpp) is shared with the
// CPU kernels; this file executes a CopyPlan on the current CUDA stream, one kernel launch
// per dtype group.
//
// Work decomposition (packing_index.h, the same functions on host and device): every
// segment is cut into tiles of at most kThreads * kVecsPerThread 16-byte destination
// vectors, one thread block per tile (the body: packing_tile.cuh). The host counts each segment's tiles and passes
// their inclusive prefix sums; a block finds its segment by binary search over them
// (uniform across the block: no shared memory, no barrier). Inside a tile each thread
// loads kVecsPerThread vectors before storing any, so enough bytes are in flight to
// reach the bandwidth of HBM, and stores whole aligned 16-byte vectors; the source is
// read with vector loads when it is aligned at the same element, else element by element
// into the vector (the destination stores stay 16-byte). The few elements before the
// destination's first 16-byte boundary and after its last one are done one at a time.
//
// The segment table travels in the kernel's parameters when it fits (up to kInlineTable
// segments: 4 KiB of parameters), so a small op is one launch and nothing else; larger
// tables are uploaded with one pinned H2D copy on the stream.
//
// Element conversions are those of packing_index.h, as in the CPU kernels, so results are
// bit-identical to them (NaNs included). Arithmetic uses explicit _rn intrinsics so nvcc
// does not contract dst + src * scale into an FMA: two roundings, like the CPU loops.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <vector>

#include "../plan.h"
#include "packing_tile.cuh"

namespace fsdp_native {
namespace {

using tile::GlobalTable;
using tile::InlineTable;
using tile::kThreads;
using tile::u64_t;

static_assert(tile::kCopy == static_cast<int>(Mode::kCopy) &&
                  tile::kScale == static_cast<int>(Mode::kScale) &&
                  tile::kAccumulate == static_cast<int>(Mode::kAccumulate),
              "packing_tile.cuh's modes must match plan.h's Mode");

constexpr int kInlineTable = 96;  // 96 x 40 B: the kernel's parameters stay under 4 KiB
static_assert(sizeof(InlineTable<kInlineTable>) + 3 * sizeof(int64_t) <= 4096,
              "kernel parameters are limited to 4 KiB on older CUDA versions");

template <typename S, typename D, int M, int N>
__global__ void __launch_bounds__(kThreads)
    pack_inline_kernel(const __grid_constant__ InlineTable<N> table, int64_t n_segs,
                       int64_t n_tiles, float scale) {
  for (int64_t b = blockIdx.x; b < n_tiles; b += gridDim.x) {
    tile::do_tile<S, D, M>(table, n_segs, b, static_cast<int>(threadIdx.x), scale);
  }
}

template <typename S, typename D, int M>
__global__ void __launch_bounds__(kThreads)
    pack_global_kernel(GlobalTable table, int64_t n_segs, int64_t n_tiles, float scale) {
  for (int64_t b = blockIdx.x; b < n_tiles; b += gridDim.x) {
    tile::do_tile<S, D, M>(table, n_segs, b, static_cast<int>(threadIdx.x), scale);
  }
}

// --- host side -----------------------------------------------------------------------------

// A group made ready for the device: segments in the unit the kernel indexes (elements, or
// raw words for plain copies) and the inclusive prefix sums of their tile counts.
struct DeviceGroup {
  std::vector<Segment> segs;
  std::vector<int64_t> tile_ends;
  int64_t n_tiles = 0;
  int src_kind = -1, dst_kind = -1;  // float_index, or for plain copies word_kind
  bool plain = false;
  size_t offset = 0;  // byte offset of this group's table in the upload buffer (large tables)
};

int float_index(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    default: return -1;
  }
}

int64_t kind_size(bool plain, int kind) {
  if (plain) return int64_t{1} << kind;  // kind = log2(word bytes)
  return kind == 0 ? 4 : 2;
}

DeviceGroup prepare(const CopyGroup& g, Mode mode) {
  DeviceGroup d;
  d.segs = g.segments;
  d.plain = g.src_dtype == g.dst_dtype && mode == Mode::kCopy;
  if (d.plain) {
    // Bits as they are, in words of the element size (two words for 16-byte dtypes).
    const int64_t es = c10::elementSize(g.src_dtype);
    const int64_t word = std::min<int64_t>(es, 8);
    TORCH_INTERNAL_ASSERT(es % word == 0 && (word & (word - 1)) == 0,
                          "fsdp_native: no CUDA kernel for element size ", es);
    for (auto& s : d.segs) {
      s.n_copy = s.n_copy * es / word;
      s.n_zero = s.n_zero * es / word;
    }
    d.src_kind = d.dst_kind = word == 1 ? 0 : word == 2 ? 1 : word == 4 ? 2 : 3;
  } else {
    d.src_kind = float_index(g.src_dtype);
    d.dst_kind = float_index(g.dst_dtype);
    TORCH_INTERNAL_ASSERT(d.src_kind >= 0 && d.dst_kind >= 0, "fsdp_native: no CUDA kernel for ",
                          g.src_dtype, " -> ", g.dst_dtype);
  }
  const int64_t dst_es = kind_size(d.plain, d.dst_kind);
  d.tile_ends.resize(d.segs.size());
  d.n_tiles = tile::count_tiles(d.segs.data(), static_cast<int64_t>(d.segs.size()), dst_es,
                                d.tile_ends.data());
  return d;
}

unsigned grid_for(int64_t n_tiles) {
  return static_cast<unsigned>(std::min<int64_t>(n_tiles, INT_MAX));
}

template <int N>
InlineTable<N> inline_table(const DeviceGroup& g) {
  InlineTable<N> t;
  std::memset(&t, 0, sizeof(t));
  std::copy(g.segs.begin(), g.segs.end(), t.segs);
  std::copy(g.tile_ends.begin(), g.tile_ends.end(), t.tile_ends);
  return t;
}

template <typename S, typename D, Mode mode>
void launch(const DeviceGroup& g, const char* dev_base, float scale, cudaStream_t stream) {
  constexpr int M = static_cast<int>(mode);
  const int64_t n = static_cast<int64_t>(g.segs.size());
  const unsigned grid = grid_for(g.n_tiles);
  if (n <= kInlineTable) {
    pack_inline_kernel<S, D, M, kInlineTable>
        <<<grid, kThreads, 0, stream>>>(inline_table<kInlineTable>(g), n, g.n_tiles, scale);
  } else {
    const GlobalTable t{reinterpret_cast<const Segment*>(dev_base + g.offset),
                        reinterpret_cast<const int64_t*>(dev_base + g.offset + n * sizeof(Segment))};
    pack_global_kernel<S, D, M><<<grid, kThreads, 0, stream>>>(t, n, g.n_tiles, scale);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename S, typename D>
void launch_mode(const DeviceGroup& g, const char* base, Mode mode, float scale, cudaStream_t st) {
  switch (mode) {
    case Mode::kCopy: return launch<S, D, Mode::kCopy>(g, base, scale, st);
    case Mode::kScale: return launch<S, D, Mode::kScale>(g, base, scale, st);
    case Mode::kAccumulate: return launch<S, D, Mode::kAccumulate>(g, base, scale, st);
  }
}

template <typename S>
void launch_cast(const DeviceGroup& g, const char* base, Mode mode, float scale, cudaStream_t st) {
  switch (g.dst_kind) {
    case 0: return launch_mode<S, float>(g, base, mode, scale, st);
    case 1: return launch_mode<S, bf16_t>(g, base, mode, scale, st);
    default: return launch_mode<S, f16_t>(g, base, mode, scale, st);
  }
}

void launch_group(const DeviceGroup& g, const char* base, Mode mode, float scale,
                  cudaStream_t stream) {
  if (g.plain) {
    switch (g.src_kind) {
      case 0: return launch<uint8_t, uint8_t, Mode::kCopy>(g, base, scale, stream);
      case 1: return launch<uint16_t, uint16_t, Mode::kCopy>(g, base, scale, stream);
      case 2: return launch<uint32_t, uint32_t, Mode::kCopy>(g, base, scale, stream);
      default: return launch<u64_t, u64_t, Mode::kCopy>(g, base, scale, stream);
    }
  }
  switch (g.src_kind) {
    case 0: return launch_cast<float>(g, base, mode, scale, stream);
    case 1: return launch_cast<bf16_t>(g, base, mode, scale, stream);
    default: return launch_cast<f16_t>(g, base, mode, scale, stream);
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
  size_t upload = 0;  // bytes of the tables too large for the kernel parameters
  for (const auto& g : plan.groups) {
    groups.push_back(prepare(g, plan.mode));
    auto& d = groups.back();
    if (d.n_tiles == 0) {
      groups.pop_back();
      continue;
    }
    if (d.segs.size() > static_cast<size_t>(kInlineTable)) {
      d.offset = upload;
      upload += d.segs.size() * (sizeof(Segment) + sizeof(int64_t));  // both 8-byte aligned
    }
  }
  if (groups.empty()) return;

  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(plan.device.index()).stream();
  at::Tensor dev;  // alive until the launches are queued; freed in this stream's order
  const char* base = nullptr;
  if (upload > 0) {
    // One pinned staging buffer and one H2D copy on the current stream. The caching host
    // allocator records the copy's stream event, so freeing `host` at scope exit is safe.
    const at::Tensor host = at::empty({static_cast<int64_t>(upload)},
                                      at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    char* h = static_cast<char*>(host.data_ptr());
    for (const auto& d : groups) {
      if (d.segs.size() <= static_cast<size_t>(kInlineTable)) continue;
      std::memcpy(h + d.offset, d.segs.data(), d.segs.size() * sizeof(Segment));
      std::memcpy(h + d.offset + d.segs.size() * sizeof(Segment), d.tile_ends.data(),
                  d.tile_ends.size() * sizeof(int64_t));
    }
    dev = at::empty({static_cast<int64_t>(upload)},
                    at::TensorOptions().dtype(at::kByte).device(plan.device));
    dev.copy_(host, /*non_blocking=*/true);
    base = static_cast<const char*>(dev.const_data_ptr());
  }
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
