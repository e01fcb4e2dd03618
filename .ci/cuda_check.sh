#!/usr/bin/env bash
# CUDA build check (no GPU needed): in a separate venv .venv-cuda holding the CUDA build
# of torch (the newest supported), build fsdp_native as `pip install` would (setup.py decides
# on CUDA and finds the toolkit by itself; sm_90 only, to keep nvcc fast), import the result,
# check that it has the CUDA kernels, and assert through the dispatcher that every
# fsdp_native op has a CUDA kernel. The build goes to build/cuda-check/, never to fsdp_native/_C*.so, so the
# CPU build used by .venv is left alone. Exits non-zero on any failure.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
VENV="$ROOT/.venv-cuda"
PY="$VENV/bin/python"
# The newest supported torch (README, "Supported torch versions").
TORCH_VERSION="${CUDA_CHECK_TORCH_VERSION:-2.15.0}"
BUILD_BASE="$ROOT/build/cuda-check"
BUILD_LIB="$BUILD_BASE/lib"

now() { date +%s; }
t_start=$(now)

# --- 1. venv with the CUDA build of torch (skipped when already set up) ---
t0=$(now)
READY="$VENV/.ready-torch-$TORCH_VERSION"
if [[ ! -f "$READY" ]]; then
  echo "cuda_check: setting up $VENV with torch==$TORCH_VERSION"
  [[ -x "$PY" ]] || python3 -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip setuptools wheel
  # PIP_CONSTRAINT=/dev/null: the machine's pip configuration caps torch at the releases it
  # keeps on disk (2.14.1); newer ones come from PyPI.
  PIP_CONSTRAINT=/dev/null "$PY" -m pip install -q "torch==$TORCH_VERSION" ninja pybind11 setuptools wheel
  touch "$READY"
else
  echo "cuda_check: $VENV is ready (torch==$TORCH_VERSION)"
fi
"$PY" -c 'import torch, sys; assert torch.version.cuda, f"torch {torch.__version__} is not a CUDA build"; print(f"cuda_check: torch {torch.__version__}, CUDA {torch.version.cuda}")'
t_install=$(( $(now) - t0 ))
echo "cuda_check: [time] venv: ${t_install}s"

# --- 2. build with the CUDA kernels into build/cuda-check ---
t0=$(now)
command -v nvcc >/dev/null || { echo "cuda_check: FAIL: nvcc is not on PATH" >&2; exit 1; }
# No CUDA_HOME needed: setup.py takes the toolkit that the nvcc on PATH reports (a wrapper
# such as /usr/local/bin/nvcc has none beside it) and prints it ("nvcc is at ...").
echo "cuda_check: building with $(nvcc --version | tail -1), CUDA_HOME=${CUDA_HOME:-unset (setup.py finds it)}"
rm -rf "$BUILD_LIB"  # fresh package copy; objects in $BUILD_BASE/temp are reused by ninja
TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS="${MAX_JOBS:-2}" \
  "$PY" setup.py -q build --build-base "$BUILD_BASE" --build-lib "$BUILD_LIB" \
  --build-temp "$BUILD_BASE/temp"
t_build=$(( $(now) - t0 ))
echo "cuda_check: [time] build: ${t_build}s"

# --- 3. import it (from the build dir, not the source tree) and check the dispatcher ---
t0=$(now)
# -P: the source tree (cwd) is not on sys.path, so fsdp_native comes from $BUILD_LIB.
PYTHONPATH="$BUILD_LIB" "$PY" -P - "$BUILD_LIB" <<'EOF'
import os
import sys

import torch

import fsdp_native

build_lib = sys.argv[1]
ext = fsdp_native._C.__file__
assert os.path.realpath(ext).startswith(os.path.realpath(build_lib)), f"imported {ext}, not the build in {build_lib}"
print(f"cuda_check: imported {ext} (built for torch {fsdp_native._C.torch_version})")
ok = True
if fsdp_native._C.with_cuda != 1:
    print("cuda_check: FAIL: fsdp_native._C was built without CUDA kernels (with_cuda == 0)")
    ok = False

expected = {"all_gather_copy_in", "all_gather_copy_out", "reduce_scatter_copy_in", "reduce_scatter_copy_out", "stream_wait"}
ops = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("fsdp_native::"))
missing = expected - {n.split("::", 1)[1].split(".", 1)[0] for n in ops}
if missing:
    print(f"cuda_check: FAIL: ops not registered: {sorted(missing)}")
    ok = False
# The quantized all-gather ops run their C++ kernels on CPU only: on CUDA tensors
# fsdp_native.quant calls their Triton twins (kernels/quant.py, *_triton ops), which are
# registered when that module is imported and need no CUDA build.
cpu_only = {"quantize_copy_in", "dequantize_copy_out", "quantize_amax"}
# Ops without tensor arguments have one kernel for every device (no dispatch).
no_tensors = {"quant_cpu_isa"}
for name in ops:
    base = name.split("::", 1)[1].split(".", 1)[0]
    if base in no_tensors:
        print(f"cuda_check: skip {name}: no tensor arguments, no per-device kernel")
        continue
    if base in cpu_only or base.endswith("_triton"):
        print(f"cuda_check: skip {name}: CPU kernel; CUDA tensors go to its Triton twin")
        continue
    has = torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA")
    print(f"cuda_check: {'ok  ' if has else 'FAIL'} {name}: {'has' if has else 'has NO'} CUDA kernel")
    ok &= has
sys.exit(0 if ok else 1)
EOF
t_check=$(( $(now) - t0 ))
echo "cuda_check: [time] import+dispatch check: ${t_check}s"
echo "cuda_check: PASS (total $(( $(now) - t_start ))s: venv ${t_install}s, build ${t_build}s, check ${t_check}s)"
