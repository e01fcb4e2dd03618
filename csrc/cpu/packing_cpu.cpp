// CPU kernels of the packing ops: multithreaded over a flat list of segments,
// with the element loops compiled once per ISA (AVX-512, AVX2, baseline) and
// picked at load time, so the casts vectorise on whatever CPU runs them.
//
// Casts equal torch's `tensor.to(dtype)` bit for bit, NaNs included (see packing_index.h), and
// divide / accumulate equal `(dst.float() + src.float() * (1 / divide_factor)).to(dst.dtype)`.
//
// Ops that write at least kStreamMinBytes (FSDPN_STREAM_MIN_BYTES in the environment overrides
// it; 0 streams always) write with non-temporal stores and prefetch their source: a buffer
// far larger than the caches is then not read into them before being overwritten, and more
// misses are kept in flight (see "non-temporal stores" below and BENCHMARKS.md).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define FSDPN_HAVE_STREAM 1
#else
#define FSDPN_HAVE_STREAM 0
#endif

#include "../plan.h"

#include "clones.h"

namespace fsdp_native {
namespace {

// Storage types and bit-exact conversions (bf16_t, f16_t, to_float, from_float, convert) are
// the shared ones of packing_index.h, which the CUDA kernels use too; the element helpers
// there are always_inline, so they inline into every ISA clone below.

// --- non-temporal stores ------------------------------------------------------------------
//
// A large copy is bound by memory bandwidth. Streaming (non-temporal) stores write the
// destination without first reading it into the cache (a third less traffic for a copy), and
// prefetching the source 16 KiB ahead keeps more misses in flight than the hardware prefetcher
// does on its own. Measured on one core of an AMD EPYC (Zen 5) VM, fp32 -> bf16 cast of 6.4M
// elements repeated (source partly in L3): 1.15 ms plain stores, 0.90 ms streamed, 0.72 ms
// streamed and prefetched; with cold caches 1.20 / 1.05 ms (plain / streamed + prefetched).
// Plain copies: 103 MB in 2.8 MB segments, glibc memcpy 6.6 ms, 64-byte streaming 5.75 ms,
// 16-byte streaming 6.8 ms (hence per-ISA bodies for them).

constexpr int64_t kStreamMinBytes = int64_t{4} << 20;
// Staging block of a streamed cast: computed into L1, then streamed out.
constexpr int64_t kStageBytes = 512;
// How far ahead of the element being read the source is prefetched.
constexpr int64_t kPrefetchBytes = 16 << 10;

int64_t stream_min_bytes() {
  static const int64_t v = [] {
    const char* e = std::getenv("FSDPN_STREAM_MIN_BYTES");
    if (e == nullptr || *e == '\0') return kStreamMinBytes;
    char* end = nullptr;
    const long long x = std::strtoll(e, &end, 10);
    return (end != e && x >= 0) ? static_cast<int64_t>(x) : kStreamMinBytes;
  }();
  return v;
}

FSDPN_INLINE int64_t bytes_to_align(const void* p, int64_t alignment) {
  return static_cast<int64_t>((alignment - (reinterpret_cast<uintptr_t>(p) % alignment)) % alignment);
}

// Prefetches [p, p + bytes) for reading, a line at a time (a prefetch never faults, so running
// past the end of the buffer is harmless).
FSDPN_INLINE void prefetch_range(const char* p, int64_t bytes) {
  for (int64_t k = 0; k < bytes; k += 64) __builtin_prefetch(p + k, 0, 3);
}

// Streams kStageBytes from `src` (16-byte aligned) to 16-byte aligned `dst`. SSE2 is in every
// x86-64 clone; wider streaming stores would need per-ISA code outside target_clones, and the
// casts gain little from them (the plain copies below do use them).
FSDPN_INLINE void stream_stage(const void* __restrict src, void* __restrict dst) {
#if FSDPN_HAVE_STREAM
  const char* s = static_cast<const char*>(src);
  char* d = static_cast<char*>(dst);
  for (int64_t i = 0; i < kStageBytes; i += 16) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i),
                     _mm_load_si128(reinterpret_cast<const __m128i*>(s + i)));
  }
#else
  std::memcpy(dst, src, static_cast<size_t>(kStageBytes));
#endif
}

#if FSDPN_HAVE_STREAM
// Plain copies: one function per vector width, picked once at load time. `dst` is aligned
// to the width; the body is a multiple of 256 bytes.
__attribute__((target("avx512f"))) void stream_body_avx512(const char* s, char* d, int64_t n) {
  for (int64_t i = 0; i < n; i += 256) {
    prefetch_range(s + i + kPrefetchBytes, 256);
    const __m512i a = _mm512_loadu_si512(s + i), b = _mm512_loadu_si512(s + i + 64);
    const __m512i c = _mm512_loadu_si512(s + i + 128), e = _mm512_loadu_si512(s + i + 192);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i), a);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i + 64), b);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i + 128), c);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i + 192), e);
  }
}
__attribute__((target("avx"))) void stream_body_avx(const char* s, char* d, int64_t n) {
  for (int64_t i = 0; i < n; i += 256) {
    prefetch_range(s + i + kPrefetchBytes, 256);
    for (int64_t k = 0; k < 256; k += 128) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + k));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + k + 32));
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + k + 64));
      const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + k + 96));
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + k), a);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + k + 32), b);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + k + 64), c);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + k + 96), e);
    }
  }
}
void stream_body_sse2(const char* s, char* d, int64_t n) {
  for (int64_t i = 0; i < n; i += 256) {
    prefetch_range(s + i + kPrefetchBytes, 256);
    for (int64_t k = 0; k < 256; k += 16) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + k),
                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + k)));
    }
  }
}

struct StreamBody {
  void (*fn)(const char*, char*, int64_t);
  int64_t align;
};

const StreamBody& stream_body() {
  static const StreamBody body = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return StreamBody{stream_body_avx512, 64};
    if (__builtin_cpu_supports("avx")) return StreamBody{stream_body_avx, 32};
    return StreamBody{stream_body_sse2, 16};
  }();
  return body;
}
#endif

// memcpy with streaming stores for the aligned body of dst.
void stream_memcpy(const void* src, void* dst, int64_t bytes) {
#if FSDPN_HAVE_STREAM
  const StreamBody& sb = stream_body();
  const char* s = static_cast<const char*>(src);
  char* d = static_cast<char*>(dst);
  const int64_t head = std::min(bytes, bytes_to_align(d, sb.align));
  std::memcpy(d, s, static_cast<size_t>(head));
  const int64_t body = (bytes - head) & ~int64_t{255};
  sb.fn(s + head, d + head, body);
  std::memcpy(d + head + body, s + head + body, static_cast<size_t>(bytes - head - body));
#else
  std::memcpy(dst, src, static_cast<size_t>(bytes));
#endif
}

// dst[i] = f(i) for i < n. With `stream`, the 16-byte aligned body of dst is written
// kStageBytes at a time through an L1-resident staging block with streaming stores, the
// source (`src`, `src_es` bytes an element) prefetched kPrefetchBytes ahead.
template <typename D, typename F>
FSDPN_INLINE void store_loop(D* __restrict dst, int64_t n, bool stream, const void* src,
                             int64_t src_es, F f) {
  int64_t i = 0;
  if (stream && reinterpret_cast<uintptr_t>(dst) % sizeof(D) == 0) {
    constexpr int64_t kBlock = kStageBytes / static_cast<int64_t>(sizeof(D));
    const int64_t head = std::min(n, bytes_to_align(dst, 16) / static_cast<int64_t>(sizeof(D)));
    for (; i < head; ++i) dst[i] = f(i);
    const char* s = static_cast<const char*>(src);
    alignas(64) D buf[kBlock];
    for (; i + kBlock <= n; i += kBlock) {
      prefetch_range(s + i * src_es + kPrefetchBytes, kBlock * src_es);
      for (int64_t j = 0; j < kBlock; ++j) buf[j] = f(i + j);
      stream_stage(buf, dst + i);
    }
  }
  for (; i < n; ++i) dst[i] = f(i);
}

template <typename S, typename D>
FSDPN_INLINE void cast_loop(const S* __restrict src, D* __restrict dst, int64_t n, bool stream) {
  store_loop(dst, n, stream, src, sizeof(S),
             [&](int64_t i) FSDPN_LAMBDA_INLINE { return convert<S, D>(src[i]); });
}
template <typename S, typename D>
FSDPN_INLINE void scale_loop(const S* __restrict src, D* __restrict dst, int64_t n, float scale,
                       bool stream) {
  store_loop(dst, n, stream, src, sizeof(S),
             [&](int64_t i) FSDPN_LAMBDA_INLINE { return from_float<D>(to_float(src[i]) * scale); });
}
template <typename S, typename D>
FSDPN_INLINE void accumulate_loop(const S* __restrict src, D* __restrict dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) dst[i] = from_float<D>(to_float(dst[i]) + to_float(src[i]) * scale);
}

using ElemFn = void (*)(const void*, void*, int64_t, float, bool);

// One multiversioned entry point per (mode, src, dst); the template bodies inline into each clone.
#define FSDPN_DEFINE(S, D)                                                                     \
  FSDPN_MULTIVERSION void cast_##S##_##D(const void* s, void* d, int64_t n, float, bool st) {  \
    cast_loop(static_cast<const S*>(s), static_cast<D*>(d), n, st);                            \
  }                                                                                            \
  FSDPN_MULTIVERSION void scale_##S##_##D(const void* s, void* d, int64_t n, float k,          \
                                          bool st) {                                           \
    scale_loop(static_cast<const S*>(s), static_cast<D*>(d), n, k, st);                        \
  }                                                                                            \
  FSDPN_MULTIVERSION void acc_##S##_##D(const void* s, void* d, int64_t n, float k, bool) {    \
    accumulate_loop(static_cast<const S*>(s), static_cast<D*>(d), n, k);                       \
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

// Destination bytes a group writes.
int64_t dst_bytes(const CopyGroup& g) {
  int64_t n = 0;
  for (const auto& seg : g.segments) n += segment_len(seg);
  return n * static_cast<int64_t>(c10::elementSize(g.dst_dtype));
}

void run_group(const CopyGroup& g, Mode mode, float scale, bool stream) {
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
      const SegmentPiece p = segment_piece(seg, ends[s] - segment_len(seg), idx, end);
      if (p.copy_lo < p.copy_hi) {
        const void* src = static_cast<const char*>(seg.src) + p.copy_lo * src_es;
        void* dst = static_cast<char*>(seg.dst) + p.copy_lo * dst_es;
        const int64_t cnt = p.copy_hi - p.copy_lo;
        if (!plain) fn(src, dst, cnt, scale, stream);
        else if (stream) stream_memcpy(src, dst, cnt * dst_es);
        else std::memcpy(dst, src, static_cast<size_t>(cnt * dst_es));
      }
      if (p.zero_lo < p.zero_hi) {
        std::memset(static_cast<char*>(seg.dst) + p.zero_lo * dst_es, 0,
                    static_cast<size_t>((p.zero_hi - p.zero_lo) * dst_es));
      }
      idx = ends[s] < end ? ends[s] : end;
    }
#if FSDPN_HAVE_STREAM
    // Streaming stores are weakly ordered: make them visible before the op returns.
    if (stream) _mm_sfence();
#endif
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
  // Stream when the op writes much more than fits the caches, and does not read its
  // destination (accumulation does, so its lines are in the cache anyway).
  int64_t bytes = 0;
  for (const auto& g : plan.groups) bytes += dst_bytes(g);
  const bool stream = FSDPN_HAVE_STREAM && plan.mode != Mode::kAccumulate && bytes >= stream_min_bytes();
  for (const auto& g : plan.groups) run_group(g, plan.mode, static_cast<float>(plan.scale), stream);
}

TORCH_LIBRARY_IMPL(fsdp_native, CPU, m) {
  m.impl("all_gather_copy_in", &all_gather_copy_in_cpu);
  m.impl("all_gather_copy_out", &all_gather_copy_out_cpu);
  m.impl("reduce_scatter_copy_in", &reduce_scatter_copy_in_cpu);
  m.impl("reduce_scatter_copy_out", &reduce_scatter_copy_out_cpu);
  m.impl("stream_wait", &stream_wait_cpu);
}

}  // namespace fsdp_native
