// Compiler settings of the CPU kernel files (packing_cpu.cpp, quant_cpu.cpp), included after
// their other headers: the element loops are compiled once per ISA and picked at load time.
#pragma once

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define FSDPN_MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define FSDPN_MULTIVERSION
#endif
// No a + b * c -> fma(a, b, c) contraction: every clone (FMA or not) rounds once per operation,
// as torch's `(dst.float() + src.float() * scale).to(dst.dtype)`, the quantization reference
// and the Triton kernels do, so all of them write the same bits.
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif
// The element loops must inline into every clone (GCC does not inline across different target
// options on its own), else they run as baseline SSE2 code.
#if defined(__GNUC__)
#define FSDPN_INLINE inline __attribute__((always_inline))
#define FSDPN_LAMBDA_INLINE __attribute__((always_inline))
#else
#define FSDPN_INLINE inline
#define FSDPN_LAMBDA_INLINE
#endif
