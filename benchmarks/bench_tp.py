"""FSDP + tensor parallelism on CPU: torch FSDP2 and fsdp_native on the same 2-D setup, 4 gloo
ranks as ("dp", "tp") = (2, 2), the two alternating step by step in the same processes (one
thread each).

    .venv/bin/python benchmarks/bench_tp.py [--steps 10] [--dim 512] [--blocks 6] [--seq 64]

Model: ``--blocks`` pre-norm residual MLP blocks (LayerNorm, dim -> 4 dim -> dim), the Linears
column- then row-wise parallel over "tp" (the norm plain), each block a unit over "dp", plus the
root (input and output Linears); batch 4 x ``--seq`` tokens per data-parallel rank; AdamW.
Prints the median step time (max over ranks) per implementation with its range, the ratio
fsdp_native / torch, and whether the losses were equal bit for bit.
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks import harness as H  # noqa: E402


def _rank(rank: int, world_size: int, port: int, steps: int, dim: int, blocks: int, seq: int) -> dict:
    H.init_pg(rank, world_size, port)
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import fsdp_native

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    def make(shard):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(dim, dim), *[H.ResidualMLP(dim, 4 * dim, norm=True) for _ in range(blocks)], nn.Linear(dim, 8))
        for block in model[1:-1]:
            parallelize_module(block, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
            shard(block, mesh=mesh["dp"])
        shard(model, mesh=mesh["dp"])
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    runs = {"torch": make(torch_fully_shard), "fsdp_native": make(fsdp_native.fully_shard)}
    losses: dict[str, list[float]] = {name: [] for name in runs}
    x = torch.randn(4, seq, dim, generator=torch.Generator().manual_seed(mesh.get_local_rank("dp")))

    def step(run):
        name, model, opt = run
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses[name].append(loss.item())

    out = H.alternate_steps({name: (name, *run) for name, run in runs.items()}, step, steps, warmup=2)
    out["same_losses"] = losses["torch"] == losses["fsdp_native"]
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args(argv)
    res = H.run_ranks(_rank, args.steps, args.dim, args.blocks, args.seq, world_size=4)
    H.print_against_torch(res)


if __name__ == "__main__":
    main()
