"""Per-op cost of the elementwise ops of an optimizer step on one parameter shard: a plain
DTensor, fsdp_native's ShardedDTensor (same spec object for all operands, as a parameter, its
gradient and its optimizer states have) and the plain local tensors.

    .venv/bin/python benchmarks/bench_dtensor_ops.py [--rows 64 --cols 128 --iters 2000] [--params 56]

One process, gloo, world size 1, one thread; prints microseconds per op (best of 3 rounds).
Then one ``AdamW(foreach=True).step()`` over `--params` such shards (the multi-tensor path
torch's optimizers take on CUDA; 56 is the LoRA adapters of bench_gpu's NF4 QLoRA model) and
one ``clip_grad_norm_`` (per tensor, as on CPU, and foreach, as on CUDA), in milliseconds per
call, best of 3 rounds of `--iters` / 20 calls.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Shard, distribute_tensor  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks import harness as H  # noqa: E402

OPS = {
    "p.mul_(number)": lambda p, g: p.mul_(0.99),
    "p.lerp_(g, number)": lambda p, g: p.lerp_(g, 0.1),
    "p.addcmul_(g, g, value=)": lambda p, g: p.addcmul_(g, g, value=0.001),
    "g.sqrt()": lambda p, g: g.sqrt(),
    "g / number": lambda p, g: g / 0.5,
    "p.add_(number)": lambda p, g: p.add_(1e-8),
    "p.addcdiv_(g, g, value=)": lambda p, g: p.addcdiv_(g, g, value=-0.01),
}


def _best_of_3(fn, warmup: int, calls: int) -> float:
    """Seconds per call of `fn`: the fastest of 3 rounds of `calls` calls, each after `warmup`."""
    best = float("inf")
    for _ in range(3):
        for _ in range(warmup):
            fn()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--cols", type=int, default=128)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--params", type=int, default=56)
    args = ap.parse_args()
    torch.set_num_threads(1)
    H.init_single_process_group("gloo")
    from fsdp_native._dtensor import make_sharded

    mesh = init_device_mesh("cpu", (1,))
    p = distribute_tensor(torch.randn(args.rows, args.cols), mesh, [Shard(0)])
    g = distribute_tensor(torch.randn(args.rows, args.cols).abs(), mesh, [Shard(0)])
    sp = make_sharded(p.to_local().clone(), p._spec)
    sg = make_sharded(g.to_local().clone(), p._spec)
    kinds = {"DTensor": (p, g), "ShardedDTensor": (sp, sg), "plain": (p.to_local().clone(), g.to_local().clone())}
    print(f"shard {args.rows}x{args.cols} fp32, us per op (best of 3 x {args.iters})")
    print(f"| op | {' | '.join(kinds)} |")
    print("|---|" + "---|" * len(kinds))
    totals = dict.fromkeys(kinds, 0.0)
    with torch.no_grad():
        for name, op in OPS.items():
            cells = []
            for kind, operands in kinds.items():
                best = _best_of_3(lambda: op(*operands), warmup=50, calls=args.iters) * 1e6
                totals[kind] += best
                cells.append(f"{best:.1f}")
            print(f"| `{name}` | {' | '.join(cells)} |")
    print(f"| all of the above | {' | '.join(f'{v:.1f}' for v in totals.values())} |")

    def shards(kind):
        out = []
        for _ in range(args.params):
            d = distribute_tensor(torch.randn(args.rows, args.cols), mesh, [Shard(0)])
            local = d.to_local().clone()
            p = torch.nn.Parameter({"DTensor": d, "ShardedDTensor": make_sharded(local, d._spec), "plain": local}[kind])
            g = torch.randn_like(local)  # a gradient of the parameter's own type and spec
            p.grad = {"DTensor": DTensor(g, d._spec, requires_grad=False), "ShardedDTensor": make_sharded(g, d._spec), "plain": g}[kind]
            out.append(p)
        return out

    steps = max(args.iters // 20, 1)
    whole = {
        "AdamW(foreach=True).step()": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True).step,
        "clip_grad_norm_ (CPU default: per tensor)": lambda ps: lambda: torch.nn.utils.clip_grad_norm_(ps, 1e9),
        "clip_grad_norm_(foreach=True)": lambda ps: lambda: torch.nn.utils.clip_grad_norm_(ps, 1e9, foreach=True),
    }
    for name, make in whole.items():
        cells = []
        for kind in kinds:
            best = _best_of_3(make(shards(kind)), warmup=1, calls=steps) * 1e3
            cells.append(f"{best:.2f} ms")
        print(f"| {name}, {args.params} parameters | {' | '.join(cells)} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
