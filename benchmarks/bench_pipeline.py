"""Pipeline parallelism (``torch.distributed.pipelining``) over FSDP on CPU: torch FSDP2 and
fsdp_native on the same setup, 4 gloo ranks as ("pp", "dp") = (2, 2), the two alternating step
by step in the same processes (one thread each).

    .venv/bin/python benchmarks/bench_pipeline.py [--steps 10] [--dim 512] [--blocks 3] [--seq 64]
        [--schedule 1f1b|gpipe] [--micro 4]

Model: each of the 2 stages has ``--blocks`` pre-norm residual MLP blocks (LayerNorm, dim ->
4 dim -> dim), each a unit over "dp", plus the stage's root (the first stage's input Linear,
the last one's output Linear); ``--micro`` micro-batches of 2 x ``--seq`` tokens per
data-parallel rank; AdamW. Prints the median step time (max over ranks) per implementation with
its range, the ratio fsdp_native / torch, and whether the last stage's losses were equal bit
for bit.
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks import harness as H  # noqa: E402


def _rank(rank: int, world_size: int, port: int, steps: int, dim: int, blocks: int, seq: int, schedule: str, micro: int) -> dict:
    H.init_pg(rank, world_size, port)
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    import fsdp_native

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp = mesh.get_local_rank("pp")

    def make(shard):
        torch.manual_seed(0)
        layers = [H.ResidualMLP(dim, 4 * dim, norm=True) for _ in range(blocks)]
        for block in layers:
            shard(block, mesh=mesh["dp"])
        chunk = nn.Sequential(*([nn.Linear(dim, dim)] if pp == 0 else []), *layers, *([nn.Linear(dim, 8)] if pp == 1 else []))
        shard(chunk, mesh=mesh["dp"])
        stage = PipelineStage(chunk, pp, 2, torch.device("cpu"), group=mesh.get_group("pp"))
        cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
        sched = cls(stage, micro, loss_fn=lambda out, y: (out - y).pow(2).mean())
        return sched, torch.optim.AdamW(chunk.parameters(), lr=1e-3)

    runs = {"torch": make(torch_fully_shard), "fsdp_native": make(fsdp_native.fully_shard)}
    losses: dict[str, list[float]] = {name: [] for name in runs}
    gen = torch.Generator().manual_seed(mesh.get_local_rank("dp"))
    x, y = torch.randn(2 * micro, seq, dim, generator=gen), torch.randn(2 * micro, seq, 8, generator=gen)

    def step(run):
        name, sched, opt = run
        if pp == 0:
            sched.step(x)
        else:
            out: list = []
            sched.step(target=y, losses=out)
            losses[name] += [v.item() for v in out]
        opt.step()
        opt.zero_grad()

    out = H.alternate_steps({name: (name, *run) for name, run in runs.items()}, step, steps, warmup=2)
    flags = torch.tensor([float(losses["torch"] == losses["fsdp_native"])])
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    out["same_losses"] = bool(flags.item())
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    ap.add_argument("--micro", type=int, default=4)
    args = ap.parse_args(argv)
    res = H.run_ranks(_rank, args.steps, args.dim, args.blocks, args.seq, args.schedule, args.micro, world_size=4)
    print(f"torch {torch.__version__}, schedule {args.schedule}, {args.micro} micro-batches")
    H.print_against_torch(res)


if __name__ == "__main__":
    main()
