// Not part of the extension (setup.py builds csrc/cuda/*.cu only): a host program that runs
// the CUDA packing kernels' tile body (packing_tile.cuh) on the CPU, for every tile and every
// thread of random plans, and checks every byte of the destination. Built and run by
// tests/test_cuda_build.py::test_tile_body_on_host:
//
//   c++ -std=c++17 -O1 -ffp-contract=off -fno-strict-aliasing -DFSDPN_TILE_HOST_CHECKS
//       -I csrc csrc/cuda/tile_host_test.cpp -o tile_host_test; ./tile_host_test
//
// Threads of a block share nothing (no shared memory, no barrier) and write disjoint
// elements, so running them one after the other is what the device computes. With
// FSDPN_TILE_HOST_CHECKS every vector access is checked for the alignment the device needs.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/packing_tile.cuh"

using namespace fsdp_native;
using namespace fsdp_native::tile;

namespace {

int g_failures = 0;
int64_t g_vector_segments = 0, g_scalar_src_segments = 0;

struct Plan {
  std::vector<Segment> segs;
  std::vector<int64_t> tile_ends;
  int64_t n_tiles = 0;
};

// Segment lengths that stress the decomposition: tiny, around a tile, several tiles.
int64_t pick_len(std::mt19937_64& rng, int64_t tile, int64_t max_len) {
  switch (rng() % 6) {
    case 0: return rng() % 4;
    case 1: return 1 + rng() % 40;
    case 2: return tile - 2 + static_cast<int64_t>(rng() % 5);
    case 3: return 2 * tile + static_cast<int64_t>(rng() % 37);
    case 4: return rng() % max_len;
    default: return 1 + rng() % 1000;
  }
}

template <typename S, typename D, int M>
void run_case(std::mt19937_64& rng, const char* name, int n_segs, int64_t max_len, int table_kind,
              bool aligned) {
  constexpr int64_t ses = sizeof(S), des = sizeof(D);
  const int64_t tile = tile_elems(des);
  // Random segment shapes; the source and destination of each at random element offsets
  // (so their 16-byte alignments differ) unless `aligned`.
  std::vector<int64_t> n_copy(n_segs), n_zero(n_segs), src_off(n_segs), dst_off(n_segs);
  int64_t src_bytes = 64, dst_bytes = 64;
  for (int i = 0; i < n_segs; ++i) {
    n_copy[i] = pick_len(rng, tile, max_len);
    n_zero[i] = rng() % 3 == 0 ? static_cast<int64_t>(rng() % 50) : 0;
    if (n_copy[i] + n_zero[i] == 0) n_copy[i] = 1;  // the planner drops empty segments
    const int64_t src_skip = aligned ? (16 - src_bytes % 16) % 16 : ses * static_cast<int64_t>(rng() % 9);
    const int64_t dst_skip = aligned ? (16 - dst_bytes % 16) % 16 : des * static_cast<int64_t>(rng() % 9);
    src_off[i] = src_bytes + src_skip;
    dst_off[i] = dst_bytes + dst_skip;
    src_bytes = src_off[i] + n_copy[i] * ses;
    dst_bytes = dst_off[i] + (n_copy[i] + n_zero[i]) * des;
  }
  // 16-byte aligned buffers with random contents (any bit pattern: NaNs included).
  std::vector<uint64_t> src_buf(src_bytes / 8 + 2), dst_buf(dst_bytes / 8 + 2);
  for (auto& w : src_buf) w = rng();
  for (auto& w : dst_buf) w = rng();
  if (reinterpret_cast<uintptr_t>(src_buf.data()) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(dst_buf.data()) % 16 != 0) {
    std::fprintf(stderr, "heap buffers are not 16-byte aligned; the test needs them\n");
    std::exit(2);
  }
  char* src = reinterpret_cast<char*>(src_buf.data());
  char* dst = reinterpret_cast<char*>(dst_buf.data());
  std::vector<uint64_t> expected_buf = dst_buf;
  char* expected = reinterpret_cast<char*>(expected_buf.data());
  const float scale = M == kCopy ? 1.0f : 0.125f + static_cast<float>(rng() % 7);

  Plan p;
  for (int i = 0; i < n_segs; ++i) {
    p.segs.push_back(Segment{src + src_off[i], dst + dst_off[i], n_copy[i], n_zero[i]});
    const S* s = reinterpret_cast<const S*>(src + src_off[i]);
    D* e = reinterpret_cast<D*>(expected + dst_off[i]);
    for (int64_t k = 0; k < n_copy[i]; ++k) e[k] = Elem<S, D, M>::apply(s[k], e[k], scale);
    for (int64_t k = n_copy[i]; k < n_copy[i] + n_zero[i]; ++k) e[k] = D{};
    const int64_t head = vec_head(reinterpret_cast<uintptr_t>(dst + dst_off[i]), des);
    const int64_t vec_lo = head < 0 ? 0 : head;
    if (src_vec_aligned(reinterpret_cast<uintptr_t>(src + src_off[i]), ses, vec_lo, vec_elems(des))) {
      ++g_vector_segments;
    } else {
      ++g_scalar_src_segments;
    }
  }
  p.tile_ends.resize(n_segs);
  p.n_tiles = count_tiles(p.segs.data(), n_segs, des, p.tile_ends.data());

  auto run = [&](const auto& table) {
    for (int64_t b = 0; b < p.n_tiles; ++b) {
      for (int t = 0; t < kThreads; ++t) do_tile<S, D, M>(table, n_segs, b, t, scale);
    }
  };
  if (table_kind == 0 && n_segs <= 16) {
    InlineTable<16> t{};
    std::copy(p.segs.begin(), p.segs.end(), t.segs);
    std::copy(p.tile_ends.begin(), p.tile_ends.end(), t.tile_ends);
    run(t);
  } else if (table_kind == 1 && n_segs <= 96) {
    InlineTable<96> t{};
    std::copy(p.segs.begin(), p.segs.end(), t.segs);
    std::copy(p.tile_ends.begin(), p.tile_ends.end(), t.tile_ends);
    run(t);
  } else {
    run(GlobalTable{p.segs.data(), p.tile_ends.data()});
  }
  if (std::memcmp(dst, expected, static_cast<size_t>(dst_bytes)) != 0) {
    int64_t at = 0;
    while (dst[at] == expected[at]) ++at;
    std::fprintf(stderr, "FAIL %s: %d segments (table %d, aligned %d): first wrong byte %lld\n", name,
                 n_segs, table_kind, aligned ? 1 : 0, static_cast<long long>(at));
    ++g_failures;
  }
}

template <typename S, typename D, int M>
void run_all(std::mt19937_64& rng, const char* name) {
  for (int rep = 0; rep < 6; ++rep) {
    for (int table = 0; table < 3; ++table) {
      const int n = table == 0 ? 1 + rng() % 16 : table == 1 ? 17 + rng() % 80 : 97 + rng() % 60;
      const int64_t max_len = table == 2 ? 300 : 5 * tile_elems(sizeof(D));
      run_case<S, D, M>(rng, name, n, max_len, table, rep % 2 == 0);
    }
  }
}

}  // namespace

int main() {
  std::mt19937_64 rng(20241123);
  run_all<float, bf16_t, kCopy>(rng, "float->bf16 copy");
  run_all<float, f16_t, kCopy>(rng, "float->f16 copy");
  run_all<bf16_t, float, kCopy>(rng, "bf16->float copy");
  run_all<f16_t, bf16_t, kCopy>(rng, "f16->bf16 copy");
  run_all<uint16_t, uint16_t, kCopy>(rng, "plain 2-byte copy");
  run_all<uint8_t, uint8_t, kCopy>(rng, "plain 1-byte copy");
  run_all<uint32_t, uint32_t, kCopy>(rng, "plain 4-byte copy");
  run_all<u64_t, u64_t, kCopy>(rng, "plain 8-byte copy");
  run_all<float, float, kScale>(rng, "float->float scale");
  run_all<bf16_t, float, kScale>(rng, "bf16->float scale");
  run_all<float, bf16_t, kScale>(rng, "float->bf16 scale");
  run_all<float, float, kAccumulate>(rng, "float->float accumulate");
  run_all<bf16_t, float, kAccumulate>(rng, "bf16->float accumulate");
  run_all<bf16_t, bf16_t, kAccumulate>(rng, "bf16->bf16 accumulate");
  run_all<f16_t, f16_t, kAccumulate>(rng, "f16->f16 accumulate");
  std::printf("tile body on host: %s (%lld segments with vector loads, %lld with scalar loads)\n",
              g_failures == 0 ? "ok" : "FAILED", static_cast<long long>(g_vector_segments),
              static_cast<long long>(g_scalar_src_segments));
  return g_failures == 0 ? 0 : 1;
}
