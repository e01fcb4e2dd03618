"""Units whose forward takes and returns ``@dataclass`` states, or states in a dict subclass (an
``EasyDict``-like dict with attribute access), e.g. a mixture-of-experts block that carries its
router's auxiliary loss beside the hidden state. torch FSDP2 (from torch 2.12 on) looks into
dataclass instances and dict subclasses: it casts their floating tensors to ``param_dtype``,
registers its post-backward on the ones that require grad and hooks its pre-backward on the
outputs'. Before 2026-11-29 fsdp_native took such a state for a leaf (torch's pytree does not
know it), so the block's backward ran without its parameters gathered again and failed
(``setStorage: ... out of bounds for storage of size 0``), as on torch 2.11.

Also a block that records statistics in a dict it was passed (``h = block(h, stats)``): the
caller's dict receives them. Before 2026-12-02 fsdp_native rebuilt every container of a unit's
inputs when it registered the post-backward, so the block wrote to a copy and the entries were
lost; torch 2.13's FSDP2 keeps a container whose contents it did not replace.

Checked: a frozen and a plain dataclass, one nested in a dict, and the dict subclass; fp32 and a
bf16 policy (where torch FSDP2 turns the dict subclass into a plain dict when it casts, and
fails; fsdp_native keeps its type); losses
and parameters bit for bit torch FSDP2's (torch >= 2.12) and, in fp32, within 1e-5 of an
unsharded model trained on the mean of the ranks' losses; and that a block's inputs arrive
cast, dataclass fields included.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn

from dist_utils import assert_same_run, full_params, grid, load_impl, ref_impl, run_distributed, run_grid
from fsdp_native import _compat

STEPS, DIM = 3, 6


@dataclasses.dataclass
class State:
    h: torch.Tensor
    aux: torch.Tensor


class AttrDict(dict):
    """A dict with attribute access, as EasyDict / addict give."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def make_state(kind: str, h, aux):
    return State(h=h, aux=aux) if kind == "dataclass" else AttrDict(h=h, aux=aux)


@dataclasses.dataclass(frozen=True)
class Extras:
    scale: torch.Tensor
    tag: str = "extras"


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(DIM, 2)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))
        self.seen: list[str] = []

    def forward(self, state: State, side: dict) -> State:
        extras = side["extras"]
        self.seen.append(f"{state.h.dtype} {state.aux.dtype} {extras.scale.dtype}")
        gates = torch.softmax(self.router(state.h), dim=-1)
        out = sum(gates[..., i : i + 1] * e(state.h) for i, e in enumerate(self.experts))
        aux = state.aux + gates.float().mean(0).pow(2).sum() * extras.scale.float().sum()
        return make_state("dataclass" if isinstance(state, State) else "dict", state.h + torch.tanh(out), aux)


class Net(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.inp = nn.Linear(4, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.out = nn.Linear(DIM, 1)
        self.scale = nn.Parameter(torch.full((1,), 0.5))

    def forward(self, x):
        state = make_state(self.kind, self.inp(x), torch.zeros(()))
        side = {"extras": Extras(scale=self.scale * 1.0)}
        for b in self.blocks:
            state = b(state, side)
        return self.out(state.h).float(), state.aux.float()


def _data(step: int, rank: int):
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(5, 4, generator=gen), torch.randn(5, 1, generator=gen)


def _loss(model, x, y):
    out, aux = model(x)
    return (out - y).pow(2).mean() + 0.1 * aux


def _train(impl, kind: str, mp: bool) -> dict:
    torch.manual_seed(0)
    model = Net(kind)
    kw = dict(mp_policy=impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)) if mp else {}
    for b in model.blocks:
        impl.fully_shard(b, **kw)
    impl.fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        loss = _loss(model, *_data(step, dist.get_rank()))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return dict(losses=torch.stack(losses), params=full_params(model), seen={s for b in model.blocks for s in b.seen})


def _train_unsharded(kind: str) -> dict:
    torch.manual_seed(0)
    model = Net(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ws, losses = dist.get_world_size(), []
    for step in range(STEPS):
        per_rank = [_loss(model, *_data(step, r)) for r in range(ws)]
        (sum(per_rank) / ws).backward()
        opt.step()
        opt.zero_grad()
        losses.append(per_rank[dist.get_rank()].detach())
    return dict(losses=torch.stack(losses), params={n: p.detach() for n, p in model.named_parameters()})


def check(kind: str, mp: bool) -> None:
    impl = load_impl()
    if impl.name != "fsdp_native" and kind == "dict" and mp:  # the harness's self-check on torch FSDP2
        try:
            _train(impl, kind, mp)
        except AttributeError as e:
            assert str(e) == "'dict' object has no attribute 'h'", str(e)
            return
        raise AssertionError("torch FSDP2 now keeps a dict subclass's type when it casts: compare with it")
    got = _train(impl, kind, mp)
    dtype = "torch.bfloat16" if mp else "torch.float32"
    assert got["seen"] == {f"{dtype} {dtype} {dtype}"}, f"[{impl.name}] mp={mp}: block inputs {got['seen']}"
    if not mp:
        assert_same_run(f"[{impl.name}] {kind} vs unsharded", got, _train_unsharded(kind), dict(rtol=1e-5, atol=1e-5))
    if kind == "dict" and mp:
        # torch FSDP2 casts a dict subclass's tensors into a plain dict, which loses the
        # attribute access ('dict' object has no attribute 'h'); fsdp_native keeps the type.
        # The same states as a dataclass give the same numbers.
        assert_same_run(f"[{impl.name}] {kind} mp={mp} vs dataclass", got, _train(impl, "dataclass", mp))
    elif _compat.TORCH_VERSION >= (2, 12):  # torch 2.11's FSDP2 fails on these states too
        assert_same_run(f"[{impl.name}] {kind} mp={mp} vs torch", got, _train(ref_impl(), kind, mp))


class SinkBlock(nn.Module):
    """``forward(h, stats)``: records its router's load (a count) in the dict it is passed and
    returns the new hidden state, as training code often collects per-layer statistics."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(DIM, 2)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, h, stats: dict):
        gates = torch.softmax(self.router(h), dim=-1)
        stats[f"load{len(stats)}"] = int((gates[..., 0] > 0.5).sum())
        return h + torch.tanh(self.proj(h)) * gates[..., :1]


class SinkNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, DIM)
        self.blocks = nn.ModuleList(SinkBlock() for _ in range(3))
        self.out = nn.Linear(DIM, 1)
        self.counts: list[int] = []

    def forward(self, x):
        h, stats = self.inp(x), {}
        for b in self.blocks:
            h = b(h, stats)
        self.counts.append(len(stats))
        return self.out(h).float(), torch.zeros(())


def _train_sink(impl, mp: bool) -> dict:
    torch.manual_seed(0)
    model = SinkNet()
    if impl is not None:
        kw = dict(mp_policy=impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)) if mp else {}
        for b in model.blocks:
            impl.fully_shard(b, **kw)
        impl.fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ws, losses = dist.get_world_size(), []
    for step in range(STEPS):
        ranks = [dist.get_rank()] if impl is not None else range(ws)
        per_rank = {r: _loss(model, *_data(step, r)) for r in ranks}
        (sum(per_rank.values()) / len(ranks)).backward()
        opt.step()
        opt.zero_grad()
        losses.append(per_rank[dist.get_rank()].detach())
    params = full_params(model) if impl is not None else {n: p.detach() for n, p in model.named_parameters()}
    return dict(losses=torch.stack(losses), params=params, counts=model.counts)


def check_stats_dict(mp: bool) -> None:
    """A block writes to a dict argument that holds no tensor: the caller's dict gets every
    block's entry. torch FSDP2 keeps that dict from torch 2.13 on, without a cast (its mp cast
    and torch 2.11's post-backward registration rebuild every container: the entries are lost)."""
    impl = load_impl()
    got = _train_sink(impl, mp)
    keeps = impl.name == "fsdp_native" or (not mp and _compat.TORCH_VERSION >= (2, 13))
    expected = [3 if keeps else 0] * STEPS
    assert got["counts"] == expected, f"[{impl.name}] mp={mp}: entries per forward {got['counts']}, expected {expected}"
    if not mp:
        assert_same_run(f"[{impl.name}] stats dict vs unsharded", got, _train_sink(None, mp), dict(rtol=1e-5, atol=1e-5))
        assert_same_run(f"[{impl.name}] stats dict vs torch", got, _train_sink(ref_impl(), mp))


def _grid():
    run_grid(grid(kind=["dataclass", "dict"], mp=[False, True]), check, name="dataclass states")
    run_grid(grid(mp=[False, True]), check_stats_dict, name="stats dict")


def test_dataclass_inputs_and_outputs_match_torch():
    run_distributed(_grid, 2, timeout=300)


def test_map_tensors_keeps_unchanged_containers():
    """fsdp_native._tree.map_tensors: a container none of whose tensors changed is the same object
    (plain and pytree-registered ones, dataclasses, dict subclasses); one with a changed tensor is
    rebuilt, of its own type; tensors are visited in tensors()' order."""
    import collections

    from fsdp_native import _tree

    Pair = collections.namedtuple("Pair", "a b")
    g, c = torch.ones(2, requires_grad=True), torch.zeros(2)
    stats, od, attr = {"n": 1}, collections.OrderedDict(x=c), AttrDict(h=c)
    tree = ([g, c], {"stats": stats, "od": od, "attr": attr, "pair": Pair(c, None), "dc": State(h=g, aux=c)}, (None, 3, "s"))
    seen = []

    def fn(t):
        seen.append(t)
        return t * 2 if t.requires_grad else t

    out = _tree.map_tensors(fn, tree)
    assert [id(t) for t in seen] == [id(t) for t in _tree.tensors(tree)]
    assert out is not tree and type(out) is tuple and type(out[0]) is list and out[0] is not tree[0]
    assert out[0][1] is c and torch.equal(out[0][0], g * 2)
    d = out[1]
    assert d is not tree[1] and d["stats"] is stats and d["od"] is od and d["attr"] is attr and d["pair"] is tree[1]["pair"]
    assert type(d["dc"]) is State and d["dc"] is not tree[1]["dc"] and d["dc"].aux is c and torch.equal(d["dc"].h, g * 2)
    assert out[2] is tree[2]
    nothing = ([c], {"stats": stats}, Pair(c, 1))
    assert _tree.map_tensors(lambda t: t, nothing) is nothing


def test_tree_walks_leave_no_reference_cycle():
    """fsdp_native._tree.tensors and map_tensors leave nothing for the cyclic garbage collector:
    with it off, the tensors a walk visited and returned are freed as soon as the caller drops
    them. A recursive closure kept them in a cycle, and on torch 2.9 the collector then cleared
    the __slots__ of a unit's marked DTensor input that only the autograd graph still held
    (the backward failed on "'DTensor' object has no attribute '_local_tensor'"; test_spmd_mesh
    runs that flow, with a collection between forward and backward)."""
    import gc
    import weakref

    from fsdp_native import _tree

    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for walk in ("tensors", "map_tensors"):
            inp = torch.ones(3)
            tree = ([inp], {"s": State(h=inp, aux=None)}, AttrDict(h=inp))
            outs = iter([torch.zeros(3) for _ in range(3)])
            got = _tree.tensors(tree) if walk == "tensors" else _tree.map_tensors(lambda t: next(outs), tree)
            refs = [weakref.ref(t) for t in (_tree.tensors(got) if walk == "map_tensors" else got)]
            assert len(refs) == 3 and all(r() is not None for r in refs), walk
            del got, outs, tree, inp
            alive = sum(r() is not None for r in refs)
            assert alive == 0, f"{walk}: {alive} of the visited tensors still held after the caller dropped them"
    finally:
        if was_enabled:
            gc.enable()
