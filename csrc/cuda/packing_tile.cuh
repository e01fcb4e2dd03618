// The body of the CUDA packing kernels: what one thread does for one tile (see
// packing_cuda.cu for the decomposition). It is a plain function of (tile, thread), with no
// shared memory and no barrier, and it also compiles as host C++: the CPU test
// tests/test_cuda_build.py::test_tile_body_on_host runs it for every tile and thread of
// random plans (misaligned pointers, odd sizes, padding) and checks every byte, so the
// kernel's work decomposition is tested on machines without a GPU.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../packing_index.h"

#if defined(__CUDACC__)
#define FSDPN_TILE __device__ __forceinline__
#else
#define FSDPN_TILE inline
#endif

// Host builds of this file (the CPU test) check that every vector access is aligned, as the
// device requires.
#if !defined(__CUDA_ARCH__) && defined(FSDPN_TILE_HOST_CHECKS)
#include <cstdio>
#include <cstdlib>
#define FSDPN_CHECK_ALIGNED(p, a)                                                       \
  do {                                                                                  \
    if (reinterpret_cast<uintptr_t>(p) % (a) != 0) {                                    \
      std::fprintf(stderr, "misaligned vector access %p (alignment %d)\n",              \
                   static_cast<const void*>(p), static_cast<int>(a));                   \
      std::abort();                                                                     \
    }                                                                                   \
  } while (0)
#else
#define FSDPN_CHECK_ALIGNED(p, a) ((void)0)
#endif

namespace fsdp_native {
namespace tile {

constexpr int kThreads = 256;
// Vectors each thread has in flight per tile: 4 x 16 B stores and up to 4 x 32 B loads.
constexpr int kVecsPerThread = 4;

// Modes, as plan.h's Mode (kCopy, kScale, kAccumulate); packing_cuda.cu checks they agree.
constexpr int kCopy = 0, kScale = 1, kAccumulate = 2;

// Destination elements per vector and per tile, for a destination of `dst_es` bytes.
FSDPN_HD constexpr int64_t vec_elems(int64_t dst_es) { return kVecBytes / dst_es; }
FSDPN_HD constexpr int64_t tile_elems(int64_t dst_es) {
  return vec_elems(dst_es) * kThreads * kVecsPerThread;
}

// Host side of the decomposition: writes the inclusive prefix sums of the segments' tile
// counts for a destination of `dst_es` bytes per element; returns the number of tiles.
inline int64_t count_tiles(const Segment* segs, int64_t n, int64_t dst_es, int64_t* tile_ends) {
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t head = vec_head(reinterpret_cast<uintptr_t>(segs[i].dst), dst_es);
    total += tile_count(segment_len(segs[i]), head, tile_elems(dst_es));
    tile_ends[i] = total;
  }
  return total;
}

// Segment tables: in the kernel's parameters (constant bank; uniform reads are broadcast) ...
template <int N>
struct InlineTable {
  Segment segs[N];
  int64_t tile_ends[N];  // inclusive prefix sums of the segments' tile counts
};

// ... or in device memory, for more segments than fit in the parameters.
struct GlobalTable {
  const Segment* segs;
  const int64_t* tile_ends;
};

// N elements of T, aligned for vector access (16-byte accesses at most; a 32-byte vector is
// two of them).
template <typename T, int N>
struct alignas(sizeof(T) * N < kVecBytes ? sizeof(T) * N : kVecBytes) Vec {
  T v[N];
};

// Raw storage of plain copies of 8- and 16-byte dtypes.
struct alignas(8) u64_t {
  uint64_t x;
};

FSDPN_TILE float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);  // never contracted into an FMA
#else
  return a * b;  // host builds compile with -ffp-contract=off
#endif
}
FSDPN_TILE float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// One element: as the CPU loops compute it (dst + src * scale with two roundings).
template <typename S, typename D, int M>
struct Elem {
  FSDPN_TILE static D apply(S s, D old, float scale) {
    if constexpr (M == kCopy) {
      return convert<S, D>(s);
    } else if constexpr (M == kScale) {
      return from_float<D>(mul_rn(to_float(s), scale));
    } else {
      return from_float<D>(add_rn(to_float(old), mul_rn(to_float(s), scale)));
    }
  }
};

// Same dtype, no arithmetic: the bits as they are (plain copies, of any dtype).
template <typename T>
struct Elem<T, T, kCopy> {
  FSDPN_TILE static T apply(T s, T, float) { return s; }
};

template <typename T>
FSDPN_TILE T* assume_global(T* p) {
#if defined(__CUDA_ARCH__)
  __builtin_assume(__isGlobal(p));  // global, not generic, loads and stores
#endif
  return p;
}

// The bits of a vector of N elements of T, in 32-bit words (2, 4 or 8 of them).
template <typename T, int N>
struct alignas(sizeof(T) * N < kVecBytes ? sizeof(T) * N : kVecBytes) Words {
  static_assert(sizeof(T) * N % 4 == 0, "a vector is whole 32-bit words");
  uint32_t w[sizeof(T) * N / 4];
};

template <typename T, int N>
FSDPN_TILE Vec<T, N> from_words(const Words<T, N>& words) {
  Vec<T, N> v;
  static_assert(sizeof(v) == sizeof(words), "a vector and its words have the same size");
  memcpy(&v, &words, sizeof(v));
  return v;
}

// The vectors of a tile: vector v (of n_vec) covers elements [lo + v V, lo + (v + 1) V).
// kSrcVec: the source is read a vector at a time (aligned like the destination), into whole
// words; else element by element.
template <typename S, typename D, int M, bool kSrcVec>
FSDPN_TILE void tile_vectors_body(const S* __restrict__ src, D* __restrict__ dst, int64_t lo, int64_t n_vec,
                                  int64_t n_copy, int tid, float scale) {
  constexpr int V = static_cast<int>(vec_elems(sizeof(D)));
  constexpr bool kReadsDst = M == kAccumulate;
  using In = typename std::conditional<kSrcVec, Words<S, V>, Vec<S, V>>::type;
  In in[kVecsPerThread];
  Words<D, V> old[kReadsDst ? kVecsPerThread : 1];
#pragma unroll
  for (int j = 0; j < kVecsPerThread; ++j) {
    const int64_t v = tid + static_cast<int64_t>(j) * kThreads;
    const int64_t k = lo + v * V;
    if (v < n_vec && k + V <= n_copy) {
      if constexpr (kSrcVec) {
        FSDPN_CHECK_ALIGNED(src + k, alignof(In));
        in[j] = *reinterpret_cast<const In*>(src + k);
      } else {
#pragma unroll
        for (int e = 0; e < V; ++e) in[j].v[e] = src[k + e];
      }
      if constexpr (kReadsDst) {
        FSDPN_CHECK_ALIGNED(dst + k, alignof(Words<D, V>));
        old[j] = *reinterpret_cast<const Words<D, V>*>(dst + k);
      }
    }
  }
  // Every load above is issued before the first store below (the compiler would otherwise
  // move a load past a store, to reuse its registers).
  asm volatile("" ::: "memory");
#pragma unroll
  for (int j = 0; j < kVecsPerThread; ++j) {
    const int64_t v = tid + static_cast<int64_t>(j) * kThreads;
    if (v < n_vec) {
      const int64_t k = lo + v * V;
      if constexpr (kSrcVec && std::is_same<S, D>::value && M == kCopy) {
        if (k + V <= n_copy) {  // a plain copy: the loaded words as they are
          FSDPN_CHECK_ALIGNED(dst + k, alignof(Words<D, V>));
          *reinterpret_cast<Words<D, V>*>(dst + k) = in[j];
          continue;
        }
      }
      Vec<D, V> out;
      if (k + V <= n_copy) {
        Vec<S, V> x;
        if constexpr (kSrcVec) {
          x = from_words(in[j]);
        } else {
          x = in[j];
        }
        if constexpr (kReadsDst) {
          const Vec<D, V> o = from_words(old[j]);
#pragma unroll
          for (int e = 0; e < V; ++e) out.v[e] = Elem<S, D, M>::apply(x.v[e], o.v[e], scale);
        } else {
#pragma unroll
          for (int e = 0; e < V; ++e) out.v[e] = Elem<S, D, M>::apply(x.v[e], D{}, scale);
        }
      } else {
        // All padding, or the one vector of the segment where copying turns into padding.
#pragma unroll
        for (int e = 0; e < V; ++e) {
          out.v[e] = k + e < n_copy ? Elem<S, D, M>::apply(src[k + e], kReadsDst ? dst[k + e] : D{}, scale) : D{};
        }
      }
      FSDPN_CHECK_ALIGNED(dst + k, alignof(Vec<D, V>));
      *reinterpret_cast<Vec<D, V>*>(dst + k) = out;
    }
  }
}

// Thread `tid` (of kThreads) of the block doing tile `b` of a table of `n_segs` segments.
template <typename S, typename D, int M, typename Table>
FSDPN_TILE void do_tile(const Table& table, int64_t n_segs, int64_t b, int tid, float scale) {
  constexpr int V = static_cast<int>(vec_elems(sizeof(D)));
  constexpr bool kReadsDst = M == kAccumulate;
  const int64_t s = find_segment(table.tile_ends, n_segs, b);
  const Segment seg = table.segs[s];
  const int64_t first_tile = s == 0 ? 0 : table.tile_ends[s - 1];
  const S* __restrict__ src = assume_global(static_cast<const S*>(seg.src));
  D* __restrict__ dst = assume_global(static_cast<D*>(seg.dst));
  const int64_t n_copy = seg.n_copy;
  const int64_t head = vec_head(reinterpret_cast<uintptr_t>(dst), sizeof(D));
  const TileSpan span = tile_span(segment_len(seg), head, tile_elems(sizeof(D)), b - first_tile);
  const TileVectors vec = tile_vectors(span, head, V);

  // Scalar elements: before the first vector and after the last one (fewer than V each,
  // or the whole tile when the destination is not element-aligned).
  const int64_t n_head = vec.vec_lo - span.lo;
  const int64_t n_scalar = n_head + (span.hi - vec.vec_hi);
  for (int64_t i = tid; i < n_scalar; i += kThreads) {
    const int64_t k = i < n_head ? span.lo + i : vec.vec_hi + (i - n_head);
    if (k < n_copy) {
      dst[k] = Elem<S, D, M>::apply(src[k], kReadsDst ? dst[k] : D{}, scale);
    } else {
      dst[k] = D{};
    }
  }

  // Vectors: all loads of this thread first, then the stores. The source is read with vector
  // loads when it lines up with the destination (`src_vec`, the same for the whole block), else
  // element by element; the two are separate paths, so that the vector path keeps each load
  // in whole 32-bit registers until its store. (Merged, the compiler split every 16-byte load
  // of 16-bit elements into eight registers right after it, the scalar path's form, and each
  // split waited for its load: one load in flight per thread instead of kVecsPerThread.)
  const int64_t n_vec = (vec.vec_hi - vec.vec_lo) / V;
  if (n_vec == 0) return;
  if (src_vec_aligned(reinterpret_cast<uintptr_t>(src), sizeof(S), vec.vec_lo, V)) {
    tile_vectors_body<S, D, M, true>(src, dst, vec.vec_lo, n_vec, n_copy, tid, scale);
  } else {
    tile_vectors_body<S, D, M, false>(src, dst, vec.vec_lo, n_vec, n_copy, tid, scale);
  }
}

}  // namespace tile
}  // namespace fsdp_native
