#!/usr/bin/env bash
# Builds and runs one of the CPU microbenchmarks here (x86-64 with AVX-512 VBMI; g++ -O3 as
# setup.py builds the extension): vector_pipes (no torch) or quant_kernels_cache (the kernels of
# csrc/cpu/quant_cpu.cpp, linked against .venv's torch). BENCHMARKS.md, "Quantized all-gather
# kernels", has what they showed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
name=${1:?usage: run.sh vector_pipes|quant_kernels_cache}
out=$(mktemp -d)/$name
if [[ $name == vector_pipes ]]; then
  g++ -O2 -std=c++17 -o "$out" benchmarks/cpu/vector_pipes.cpp
else
  torch_dir=$(.venv/bin/python -c "import os, torch; print(os.path.dirname(torch.__file__))")
  g++ -O3 -fopenmp -std=c++17 -w -Icsrc -I"$torch_dir/include" -I"$torch_dir/include/torch/csrc/api/include" \
    "benchmarks/cpu/$name.cpp" csrc/quant.cpp csrc/checks.cpp csrc/plan.cpp -o "$out" \
    -L"$torch_dir/lib" -ltorch -ltorch_cpu -lc10 -Wl,-rpath,"$torch_dir/lib"
fi
"$out"
