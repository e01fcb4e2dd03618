// CPU kernels of the packing ops: multithreaded over a flat list of segments,
// with the element loops compiled once per ISA (AVX-512, AVX2, baseline) and
// picked at load time, so the casts vectorise on whatever CPU runs them.
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "../plan.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define FSDPN_MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define FSDPN_MULTIVERSION
#endif

namespace fsdp_native {
namespace {

// Storage types: bf16 and fp16 travel as raw 16-bit words; conversions are bit math.
struct bf16_t { uint16_t x; };
struct f16_t { uint16_t x; };

inline float to_float(float v) { return v; }
inline float to_float(bf16_t v) {
  uint32_t u = bf16_to_float_bits(v.x);
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline float to_float(f16_t v) { return c10::detail::fp16_ieee_to_fp32_value(v.x); }

template <typename T> inline T from_float(float f);
template <> inline float from_float<float>(float f) { return f; }
template <> inline bf16_t from_float<bf16_t>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return bf16_t{float_bits_to_bf16(u)};
}
template <> inline f16_t from_float<f16_t>(float f) {
  return f16_t{c10::detail::fp16_ieee_from_fp32_value(f)};
}

template <typename S, typename D>
inline void cast_loop(const S* __restrict src, D* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = from_float<D>(to_float(src[i]));
}
template <typename S, typename D>
inline void scale_loop(const S* __restrict src, D* __restrict dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) dst[i] = from_float<D>(to_float(src[i]) * scale);
}
template <typename S, typename D>
inline void accumulate_loop(const S* __restrict src, D* __restrict dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) dst[i] = from_float<D>(to_float(dst[i]) + to_float(src[i]) * scale);
}

using ElemFn = void (*)(const void*, void*, int64_t, float);

// One multiversioned entry point per (mode, src, dst); the template bodies inline into each clone.
#define FSDPN_DEFINE(S, D)                                                               \
  FSDPN_MULTIVERSION void cast_##S##_##D(const void* s, void* d, int64_t n, float) {     \
    cast_loop(static_cast<const S*>(s), static_cast<D*>(d), n);                          \
  }                                                                                      \
  FSDPN_MULTIVERSION void scale_##S##_##D(const void* s, void* d, int64_t n, float k) {  \
    scale_loop(static_cast<const S*>(s), static_cast<D*>(d), n, k);                      \
  }                                                                                      \
  FSDPN_MULTIVERSION void acc_##S##_##D(const void* s, void* d, int64_t n, float k) {    \
    accumulate_loop(static_cast<const S*>(s), static_cast<D*>(d), n, k);                 \
  }
FSDPN_DEFINE(float, float)
FSDPN_DEFINE(float, bf16_t)
FSDPN_DEFINE(float, f16_t)
FSDPN_DEFINE(bf16_t, float)
FSDPN_DEFINE(bf16_t, bf16_t)
FSDPN_DEFINE(bf16_t, f16_t)
FSDPN_DEFINE(f16_t, float)
FSDPN_DEFINE(f16_t, bf16_t)
FSDPN_DEFINE(f16_t, f16_t)
#undef FSDPN_DEFINE

int float_index(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    default: return -1;
  }
}

#define FSDPN_ROW(M, S) {M##_##S##_float, M##_##S##_bf16_t, M##_##S##_f16_t}
#define FSDPN_TABLE(M) {FSDPN_ROW(M, float), FSDPN_ROW(M, bf16_t), FSDPN_ROW(M, f16_t)}
const ElemFn kCast[3][3] = FSDPN_TABLE(cast);
const ElemFn kScaleFn[3][3] = FSDPN_TABLE(scale);
const ElemFn kAccFn[3][3] = FSDPN_TABLE(acc);
#undef FSDPN_TABLE
#undef FSDPN_ROW

void memcpy_elems(const void* s, void* d, int64_t n, int64_t es) {
  std::memcpy(d, s, static_cast<size_t>(n * es));
}

void run_group(const CopyGroup& g, Mode mode, float scale) {
  const int64_t src_es = c10::elementSize(g.src_dtype);
  const int64_t dst_es = c10::elementSize(g.dst_dtype);
  const bool plain = g.src_dtype == g.dst_dtype && mode == Mode::kCopy;
  ElemFn fn = nullptr;
  if (!plain) {
    const int si = float_index(g.src_dtype), di = float_index(g.dst_dtype);
    TORCH_INTERNAL_ASSERT(si >= 0 && di >= 0, "fsdp_native: no CPU kernel for ", g.src_dtype,
                          " -> ", g.dst_dtype);
    fn = mode == Mode::kCopy ? kCast[si][di] : mode == Mode::kScale ? kScaleFn[si][di] : kAccFn[si][di];
  }
  const auto& segs = g.segments;
  const int64_t n = static_cast<int64_t>(segs.size());
  std::vector<int64_t> ends(n);
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) ends[i] = (total += segment_len(segs[i]));
  // Grain of 64K elements: small units stay on the calling thread.
  at::parallel_for(0, total, 1 << 16, [&](int64_t begin, int64_t end) {
    int64_t s = find_segment(ends.data(), n, begin);
    for (int64_t idx = begin; idx < end; ++s) {
      const Segment& seg = segs[s];
      const int64_t seg_begin = ends[s] - segment_len(seg);
      const int64_t lo = idx - seg_begin;
      const int64_t hi = std::min(end, ends[s]) - seg_begin;
      const int64_t copy_hi = std::min(hi, seg.n_copy);
      if (lo < copy_hi) {
        const void* src = static_cast<const char*>(seg.src) + lo * src_es;
        void* dst = static_cast<char*>(seg.dst) + lo * dst_es;
        if (plain) memcpy_elems(src, dst, copy_hi - lo, dst_es);
        else fn(src, dst, copy_hi - lo, scale);
      }
      const int64_t zero_lo = std::max(lo, seg.n_copy);
      if (zero_lo < hi) {
        std::memset(static_cast<char*>(seg.dst) + zero_lo * dst_es, 0,
                    static_cast<size_t>((hi - zero_lo) * dst_es));
      }
      idx = ends[s] < end ? ends[s] : end;
    }
  });
}

void all_gather_copy_in_cpu(at::TensorList shards, at::IntArrayRef padded_numels,
                            const at::Tensor& out) {
  run_plan_cpu(plan_all_gather_copy_in(shards, padded_numels, out));
}
void all_gather_copy_out_cpu(const at::Tensor& all_gather_output, at::IntArrayRef padded_numels,
                             int64_t world_size, at::TensorList outs) {
  run_plan_cpu(plan_all_gather_copy_out(all_gather_output, padded_numels, world_size, outs));
}
void reduce_scatter_copy_in_cpu(at::TensorList grads, at::IntArrayRef padded_numels,
                                int64_t world_size, const at::Tensor& out) {
  run_plan_cpu(plan_reduce_scatter_copy_in(grads, padded_numels, world_size, out));
}
void reduce_scatter_copy_out_cpu(const at::Tensor& shard, at::IntArrayRef padded_numels,
                                 double divide_factor, bool accumulate, at::TensorList grads) {
  run_plan_cpu(plan_reduce_scatter_copy_out(shard, padded_numels, divide_factor, accumulate, grads));
}

// On CPU every stream is the same in-order host execution: nothing to wait for.
void stream_wait_cpu(const at::Tensor& anchor, int64_t waiter_stream, int64_t signaler_stream) {
  (void)anchor;
  (void)waiter_stream;
  (void)signaler_stream;
}

}  // namespace

void run_plan_cpu(const CopyPlan& plan) {
  for (const auto& g : plan.groups) run_group(g, plan.mode, static_cast<float>(plan.scale));
}

TORCH_LIBRARY_IMPL(fsdp_native, CPU, m) {
  m.impl("all_gather_copy_in", &all_gather_copy_in_cpu);
  m.impl("all_gather_copy_out", &all_gather_copy_out_cpu);
  m.impl("reduce_scatter_copy_in", &reduce_scatter_copy_in_cpu);
  m.impl("reduce_scatter_copy_out", &reduce_scatter_copy_out_cpu);
  m.impl("stream_wait", &stream_wait_cpu);
}

}  // namespace fsdp_native
