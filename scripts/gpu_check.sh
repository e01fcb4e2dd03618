#!/usr/bin/env bash
# The GPU checks of fsdp_native in one command, on a machine with a GPU (../shared/GPU.md):
# builds the extension in place against the machine's torch (no .venv there), then runs
#   quant  : the Triton quantized all-gather kernels compiled for the GPU, bit for bit against
#            the C++ kernels, with and without the GPU's conversion instructions, which are also
#            checked against the integer math over every fp32 (tests/test_quant_kernels.py
#            -k cuda), and tests/test_cuda_quant.py (torchao Float8 / NF4 vs torch FSDP2, the
#            own fp8 / NF4 all-gathers, on NCCL)
#   benchops: benchmarks/bench_gpu.py --no-train     (packing and quantization kernels alone vs
#            the bandwidth floor, first: the part a short run must not lose)
#   bench  : benchmarks/bench_gpu.py                  (step time / memory vs torch FSDP2 at world
#            size 8 on the fake process group, plain, torchao Float8 and NF4 QLoRA; packing and
#            quantization kernels vs the bandwidth floor)
#   tests  : python3 -m pytest tests/test_cuda_*.py   (kernels bit for bit vs CPU, runtime parity
#            and memory vs torch FSDP2 on NCCL world size 1)
#   ncu    : (only when named) benchmarks/profile_quant_gpu.py under Nsight Compute: each quant
#            kernel once (speed of light, occupancy, launch, warp stall reasons) -> ncu.csv;
#            the stage log maps its rows onto the ops
#   tune   : (only when named) benchmarks/tune_quant_gpu.py: the Triton kernels' launch shapes
#            (tile sizes, warps a program), each checked against the default's bits, then
#            timed against the floor -> tune.json
#   against: (only when named) tune_quant_gpu.py --against GPU_CHECK_AGAINST (default
#            .whl/quant_against.py: another version of kernels/quant.py, e.g. `git show
#            REV:kernels/quant.py > .whl/quant_against.py` before the run): every quant op
#            timed with both versions, alternating, and their bits compared -> against.json
#   quantcpu: tests/test_quant_kernels.py on this machine's CPU (its best kernel level; the
#            Triton tests left out)
#   memcheck: compute-sanitizer --tool memcheck over the kernel tests
#   memsnap: (only when named) benchmarks/gpu_memory_snapshot.py on llama8b-bf16: who holds
#            the memory at the step's peak, between steps and after the forward, torch FSDP2
#            vs fsdp_native
#   profile: (only when named) benchmarks/profile_step_gpu.py on GPU_CHECK_PROFILE_CONFIG
#            (default llama8b-nf4-qlora): step and host time, device idle and where the host
#            was meanwhile, torch FSDP2 vs fsdp_native
# and writes every log, the pytest JUnit XML, bench_gpu.json and summary.txt to $OUT
# (default build/gpu_check), each as soon as its stage ends. Each stage has its own time
# limit; a failed stage does not stop the others; the exit status is non-zero if any failed.
#
#   bash scripts/gpu_check.sh                      # all stages (about 6-8 min expected)
#   bash scripts/gpu_check.sh build tests          # some stages (build, tests, bench, memcheck);
#   bash scripts/gpu_check.sh bench memcheck       # a later call reuses the in-place build
#
# Environment: PY (default python3), OUT, TORCH_CUDA_ARCH_LIST (default 9.0), MAX_JOBS
# (default: the core count), GPU_CHECK_BENCH_ARGS (extra bench_gpu.py arguments),
# GPU_CHECK_TESTS (the test files of the tests stage), GPU_CHECK_TUNE_BUDGET_S (the tune
# stage's: start no setting after this many seconds, default 200), GPU_CHECK_DEADLINE_S (stop starting
# stages, and cut each stage's limit, so that the whole run ends within this many seconds),
# GPU_CHECK_BUNDLE=1 (at the end, pack every file of $OUT but summary.txt into
# $OUT/gpu_check.tgz: a device tool that returns few files then returns them all). Wheels in
# .whl/ (torchao, which the GPU image lacks) are installed into /tmp/gpu_check_site first and
# put on PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-build/gpu_check}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
STAGES=("$@")
[[ ${#STAGES[@]} -eq 0 ]] && STAGES=(build quant benchops bench tests quantcpu memcheck)
DEADLINE=${GPU_CHECK_DEADLINE_S:-100000}

export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/gpu_check_site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/gpu_check_site
fi
if [[ -z "${CUDA_HOME:-}" ]] && command -v nvcc >/dev/null; then
  # nvcc on PATH may be a wrapper: take the toolkit nvcc itself reports.
  nvcc_bin=$(nvcc --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ _HERE_=//p' | head -1)
  [[ -n "$nvcc_bin" ]] && export CUDA_HOME=$(cd "$nvcc_bin/.." && pwd)
fi

summary="$OUT/summary.txt"
: > "$summary"
failed=0
stage() {  # stage NAME LIMIT_S CMD...: runs CMD with a time limit, log in $OUT/NAME.log
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS rc=0 left=$((DEADLINE - SECONDS - 5))
  if (( left < 20 )); then
    echo "=== gpu_check: $name: SKIPPED, ${left}s left before the deadline" | tee -a "$summary"
    failed=1
    return 0
  fi
  (( limit > left )) && limit=$left
  echo "=== gpu_check: $name: $*" | tee -a "$summary"
  timeout --kill-after=20 "$limit" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
  local line="=== gpu_check: $name: exit $rc after $((SECONDS - t0))s (log: $name.log)"
  (( rc == 124 || rc == 137 )) && line+=" TIMED OUT after ${limit}s"
  echo "$line" | tee -a "$summary"
  tail -n 15 "$OUT/$name.log" | sed 's/^/    /' | tee -a "$summary"
  (( rc != 0 )) && failed=1
  return 0
}
want() { local s; for s in "${STAGES[@]}"; do [[ $s == "$1" ]] && return 0; done; return 1; }

{
  echo "date: $(date -u +%FT%TZ)  commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.is_available() and torch.cuda.get_device_name())'
  echo "CUDA_HOME=${CUDA_HOME:-unset}"
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt" | tee -a "$summary"

if want build; then
  stage build 300 env FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" \
    MAX_JOBS="${MAX_JOBS:-$(nproc)}" "$PY" setup.py -q build_ext --inplace
  stage import 60 "$PY" -c 'import os, fsdp_native, torch
here = os.path.realpath("fsdp_native")
assert os.path.realpath(fsdp_native._C.__file__).startswith(here), f"imported {fsdp_native._C.__file__}, not the build in {here}"
assert fsdp_native._C.with_cuda == 1, "built without CUDA kernels"
print("fsdp_native", fsdp_native._C.__file__, "built for torch", fsdp_native._C.torch_version, "running", torch.__version__)'
fi
if want quant; then
  stage quant 240 "$PY" -m pytest -q -rs --durations=12 tests/test_quant_kernels.py tests/test_cuda_quant.py -k cuda
fi
if want benchops; then
  stage benchops 150 "$PY" benchmarks/bench_gpu.py --no-train --json "$OUT/bench_ops.json"
fi
if want bench; then
  # shellcheck disable=SC2086
  stage bench 300 "$PY" benchmarks/bench_gpu.py --json "$OUT/bench_gpu.json" \
    $(want benchops && echo --no-ops) ${GPU_CHECK_BENCH_ARGS:-}
fi
if want tests; then
  # shellcheck disable=SC2086
  stage tests 400 "$PY" -m pytest -q -rs --junitxml="$OUT/pytest.xml" \
    ${GPU_CHECK_TESTS:-tests/test_cuda_build.py tests/test_cuda_runtime.py tests/test_cuda_memory.py}
fi
if want memsnap; then  # not in the default stages: who holds the memory, llama8b-bf16
  stage memsnap 240 bash -c "$PY benchmarks/gpu_memory_snapshot.py llama8b-bf16 --at peak && $PY benchmarks/gpu_memory_snapshot.py llama8b-bf16 && $PY benchmarks/gpu_memory_snapshot.py llama8b-bf16 --at loss"
fi
if want profile; then  # not in the default stages: where the step's time goes
  stage profile 200 "$PY" benchmarks/profile_step_gpu.py "${GPU_CHECK_PROFILE_CONFIG:-llama8b-nf4-qlora}" \
    --json "$OUT/profile.json" --trace-dir "$OUT"
fi
if want ncu; then  # not in the default stages: the quant kernels under Nsight Compute
  ncu_bin=$(command -v ncu || echo "${CUDA_HOME:-/usr/local/cuda}/bin/ncu")
  if [[ -x $ncu_bin ]]; then
    stage ncu 240 "$ncu_bin" --nvtx --nvtx-include "profile/" --section SpeedOfLight --section Occupancy \
      --section LaunchStats --section WarpStateStats --csv --log-file "$OUT/ncu.csv" "$PY" benchmarks/profile_quant_gpu.py
  else
    echo "=== gpu_check: ncu: skipped, no ncu (PATH, \$CUDA_HOME/bin)" | tee -a "$summary"
  fi
fi
if want tune; then  # not in the default stages: the Triton kernels' launch shapes
  stage tune 300 "$PY" benchmarks/tune_quant_gpu.py --budget-s "${GPU_CHECK_TUNE_BUDGET_S:-200}" --json "$OUT/tune.json"
fi
if want against; then  # not in the default stages: another kernels/quant.py timed against this one
  stage against 240 "$PY" benchmarks/tune_quant_gpu.py --against "${GPU_CHECK_AGAINST:-.whl/quant_against.py}" \
    --json "$OUT/against.json"
fi
if want quantcpu; then
  stage quantcpu 300 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_quant_kernels.py -k "not triton and not cuda"
fi
if want memcheck; then
  if command -v compute-sanitizer >/dev/null; then
    # The kernel tests (the >2 GiB one left out: memcheck would take minutes over it).
    stage memcheck 400 compute-sanitizer --tool memcheck --error-exitcode 9 \
      "$PY" -m pytest -q -x tests/test_cuda_build.py -k "not huge"
  else
    echo "=== gpu_check: memcheck: skipped, compute-sanitizer not on PATH" | tee -a "$summary"
  fi
fi
echo "=== gpu_check: $([[ $failed == 0 ]] && echo PASSED || echo FAILED); logs in $OUT" | tee -a "$summary"
if [[ ${GPU_CHECK_BUNDLE:-0} == 1 ]]; then
  (cd "$OUT" && find . -maxdepth 1 -type f ! -name summary.txt ! -name gpu_check.tgz -printf '%f\n' > /tmp/gpu_check_files \
    && tar czf gpu_check.tgz -T /tmp/gpu_check_files && xargs rm -f < /tmp/gpu_check_files)
fi
exit $failed
