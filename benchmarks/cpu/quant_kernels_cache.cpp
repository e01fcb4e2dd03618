// The CPU quantize kernels of csrc/cpu/quant_cpu.cpp called directly, without torch's op, on
// bf16 data that fits in L1 (8192 elements), in L2 (65536) and in L3 (6.4M: a Llama-style layer
// shard), to tell compute from memory: a kernel that takes as long per element in L1 as in L3
// is bound by its arithmetic. Nanoseconds per element, fastest of 15 rounds; a glibc memcpy of
// 1.5 bytes an element (the floor's shape: bench_quant.py copies half the bytes moved) for
// scale. Build and run: bash benchmarks/cpu/run.sh quant_kernels_cache
#include "../../csrc/cpu/quant_cpu.cpp"

#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

using fsdp_native::bf16_t;
using namespace fsdp_native::quant;

volatile uint32_t g_sink;

template <class F>
double fastest(F f, int rounds) {
  double best = 1e30;
  for (int r = 0; r < rounds; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

int main() {
  if (!have_avx512x()) {
    std::puts("this CPU lacks the avx512-vbmi kernels (AVX-512 VBMI, BF16, F16C, FMA); nothing to time");
    return 0;
  }
  const int64_t total = 6400000;
  std::vector<bf16_t> src(total);
  std::mt19937 gen(0);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  for (auto& v : src) {
    const float f = normal(gen);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    v.x = static_cast<uint16_t>(u >> 16);
  }
  std::vector<uint8_t> dst(2 * total), scales(total / 16);
  std::printf("%9s %12s %12s %12s %12s %12s   (ns per element)\n", "elements", "fp8 clamp", "fp8 finite", "nf4", "amax", "memcpy 1.5B");
  for (const int64_t n : {int64_t{8192}, int64_t{65536}, total}) {
    const int reps = static_cast<int>(total / n);  // the same elements in all, n at a time
    auto per = [&](double t) { return t * 1e9 / (static_cast<double>(n) * reps); };
    const double fp8c = fastest([&] { for (int k = 0; k < reps; ++k) fp8_encode_x512<bf16_t, true>(src.data(), n, 100.0f, dst.data()); }, 15);
    const double fp8f = fastest([&] { for (int k = 0; k < reps; ++k) fp8_encode_x512<bf16_t, false, true>(src.data(), n, 100.0f, dst.data()); }, 15);
    const double nf4 = fastest([&] { for (int k = 0; k < reps; ++k) nf4_blocks_x512<bf16_t>(src.data(), n, n, n / 64, 64, dst.data(), scales.data()); }, 15);
    const double amax = fastest([&] { for (int k = 0; k < reps; ++k) g_sink = g_sink + max_abs_x512<bf16_t>(src.data(), n); }, 15);
    const double copy = fastest([&] { for (int k = 0; k < reps; ++k) std::memcpy(dst.data(), src.data(), n * 3 / 2); }, 15);
    std::printf("%9ld %12.4f %12.4f %12.4f %12.4f %12.4f\n", static_cast<long>(n), per(fp8c), per(fp8f), per(nf4), per(amax), per(copy));
  }
  return 0;
}
