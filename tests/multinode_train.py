"""Run by tests/test_multinode.py under two torchrun agents (``--nnodes 2``, c10d rendezvous,
one machine standing in for two): trains the tests' Transformer with torch FSDP2 and with
fsdp_native on the torchrun-made process group, over the whole world (1-D) and as HSDP with
the nodes as the replicate dim, and writes this rank's results to ``<out>/rank<RANK>.pt``."""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist_utils import full_params, load_impl  # noqa: E402
from models import ModelArgs, build_sharded_transformer, lm_loss, make_batches  # noqa: E402

STEPS = 3


def train(impl_name: str, mesh, data_rank: int, n_data: int, mp: bool) -> dict:
    args = ModelArgs()
    model = build_sharded_transformer(load_impl(impl_name), args, "cpu", mesh, mp=mp, reshard=True, meta=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in make_batches(args, STEPS, global_bsz=2 * n_data):
        loss = lm_loss(model(x[2 * data_rank : 2 * data_rank + 2]), y[2 * data_rank : 2 * data_rank + 2])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    return dict(losses=torch.stack(losses), params=full_params(model), placements=str(next(model.parameters()).placements))


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    nodes, local = int(os.environ["GROUP_WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    env = {k: int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE")}
    assert nodes * local == world, env
    flat = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    hsdp = init_device_mesh("cpu", (nodes, local), mesh_dim_names=("replicate", "shard"))
    result = dict(env=env, hsdp_replicate_ranks=dist.get_process_group_ranks(hsdp.get_group("replicate")))
    for impl in ("torch", "fsdp_native"):
        for mp in (False, True):
            result[(impl, "1d", mp)] = train(impl, flat, rank, world, mp)
            # HSDP: each node holds a full replica, sharded over its local ranks.
            result[(impl, "hsdp", mp)] = train(impl, hsdp, rank, world, mp)
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
