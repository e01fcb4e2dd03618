"""``FSDPModule.set_unshard_in_backward(False)``: a unit whose backward needs no parameters (an
embedding) is not all-gathered in the backward, yet its gradients, which autograd writes into
the unsharded parameters all the same, are reduced. Checked against torch FSDP2 bit for bit
(losses, gradients, parameters) and against the default (unshard in backward), with fp32, a
bf16 policy, gradient accumulation without sync, and HSDP; and that the embedding's weight
stays sharded while the backward goes through it. Before 2026-11-28 fsdp_native reduced
nothing for such a unit: the embedding's gradient was None and it never trained.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from dist_utils import assert_close, assert_same_run, full_params, load_impl, ref_impl, run_distributed, run_grid

VOCAB, DIM, STEPS, ACCUM = 32, 8, 3, 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))
        self.out = nn.Linear(DIM, VOCAB)
        self.seen_sharded: list[bool] = []  # per backward: emb.weight sharded when its output's gradient came

    def forward(self, ids):
        h = self.emb(ids)
        if h.requires_grad:
            # Runs after the unit's own pre-backward hook, registered on the same output before it.
            h.register_hook(lambda g: self.seen_sharded.append(isinstance(self.emb.weight, DTensor)) or g)
        for b in self.blocks:
            h = torch.relu(b(h))
        return self.out(h)


def _train(impl, cfg: dict, unshard_in_backward: bool) -> dict:
    torch.manual_seed(0)
    model = Net()
    ws = dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("replicate", "shard")) if cfg.get("hsdp") else init_device_mesh("cpu", (ws,))
    kw = dict(mesh=mesh)
    if cfg.get("mp"):
        kw["mp_policy"] = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for m in (model.emb, *model.blocks):
        impl.fully_shard(m, **kw)
    impl.fully_shard(model, **kw)
    model.emb.set_unshard_in_backward(unshard_in_backward)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(10 + dist.get_rank())
    accum = ACCUM if cfg.get("accum") else 1
    losses, first_grads = [], None
    for step in range(STEPS):
        for micro in range(accum):
            model.set_requires_gradient_sync(micro == accum - 1)
            ids = torch.randint(0, VOCAB, (4, 5), generator=gen)
            loss = F.cross_entropy(model(ids).float().flatten(0, 1), ids.flatten())
            loss.backward()
            losses.append(loss.item())
        if step == 0:
            first_grads = {n: None if p.grad is None else p.grad.full_tensor() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return dict(losses=losses, params=full_params(model), grads=first_grads, seen_sharded=model.seen_sharded)


def check(**cfg) -> None:
    impl, torch_impl = load_impl(), ref_impl()
    got = _train(impl, cfg, False)
    default = _train(impl, cfg, True)
    expected_seen = [True] * (STEPS * (ACCUM if cfg.get("accum") else 1))
    assert got["seen_sharded"] == expected_seen, f"[{impl.name}] {cfg}: emb.weight sharded in its backward: {got['seen_sharded']}"
    assert not any(default["seen_sharded"]), f"[{impl.name}] {cfg}: emb.weight not unsharded in the default's backward"
    missing = [n for n, g in got["grads"].items() if g is None]
    assert not missing, f"[{impl.name}] {cfg}: no gradient for {missing}"
    for n, g in got["grads"].items():
        assert_close(f"[{impl.name}] {cfg}: first gradient of {n} vs unshard in backward", g, default["grads"][n], dict(rtol=0, atol=0))
    assert_same_run(f"[{impl.name}] {cfg} vs unshard in backward", got, default)
    theirs = _train(torch_impl, cfg, False)
    for n, g in got["grads"].items():
        assert_close(f"[{impl.name}] {cfg}: first gradient of {n} vs torch", g, theirs["grads"][n], dict(rtol=0, atol=0))
    assert_same_run(f"[{impl.name}] {cfg} vs torch", got, theirs)


def _grid():
    configs = [dict(), dict(mp=True), dict(accum=True), dict(accum=True, mp=True), dict(hsdp=True, accum=True)]
    run_grid(configs, lambda **cfg: check(**cfg), name="unshard-in-backward")


def test_unshard_in_backward_matches_torch():
    run_distributed(_grid, 4, timeout=400)
