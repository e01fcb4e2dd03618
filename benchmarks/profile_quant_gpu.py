"""The quantized all-gather kernels one by one, for Nsight Compute: each op that
``bench_gpu.py`` times (rank 3's bf16 shards of one Llama-3-8B layer over 8 ranks: quantize
into the rank's chunk, dequantize 8 gathered chunks; on GPUs with conversion instructions also
with the integer math) is called twice to warm up (compiles, plans, tables), then once inside
an NVTX range ``profile``, so that

    ncu --nvtx --nvtx-include "profile/" --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats --csv --log-file ncu.csv \\
        python3 benchmarks/profile_quant_gpu.py

profiles each of its kernels once (``scripts/gpu_check.sh ncu`` runs this). It prints every
op with the Triton kernels it launched, in launch order: ncu's rows, also in launch order,
map onto them. What the rowwise kernels' and the NF4 quantize's limits are (latency or issue,
BENCHMARKS.md "Quantized all-gather kernels") is what this is for.

    .venv/bin/python benchmarks/profile_quant_gpu.py --smoke   # CPU, tiny shapes: the code path
    TRITON_INTERPRET=1 .venv/bin/python benchmarks/profile_quant_gpu.py --smoke --triton
"""
from __future__ import annotations

import argparse
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402

from benchmarks import bench_gpu as B  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes (C++ kernels, no NVTX)")
    ap.add_argument("--triton", action="store_true", help="with --smoke: the Triton kernels on CPU (TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        ap.error("needs a GPU (or --smoke)")
    device = torch.device("cpu") if args.smoke else torch.device("cuda", torch.cuda.current_device())
    shapes = (B.LLAMA_SMOKE if args.smoke else B.LLAMA).layer_shapes()
    launched: list[str] = []
    if device.type == "cuda" or args.triton:
        from fsdp_native import quant as Q

        Q._import_triton_kernels()
        from fsdp_native.kernels import quant as K

        if device.type != "cuda":  # the CUDA path's ops on CPU tensors, interpreted
            Q._ops_for = lambda t: Q._Ops(K.quantize_copy_in_eager, K.dequantize_copy_out_eager, K.quantize_amax_eager, False)

        run = K._run

        def counting(launches, env):
            launched.extend(L.kernel.fn.__name__ for L in launches)
            return run(launches, env)

        K._run = counting
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for case in B.quant_op_cases("llama8b layer", shapes, device):
        for _ in range(0 if args.smoke else 2):  # warm-up (none for --smoke: it lists launches, times nothing)
            case.op()
        sync()
        launched.clear()
        if device.type == "cuda":
            torch.cuda.nvtx.range_push("profile")
        case.op()
        sync()
        if device.type == "cuda":
            torch.cuda.nvtx.range_pop()
        print(f"{case.name}: {', '.join(launched) or '(no Triton launch)'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
