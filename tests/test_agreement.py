"""Structure agreement (fsdp_native/_agreement.py): ranks that sharded different modules, or
the same modules differently, raise the same ValueError on every rank at the first forward,
naming what differs; never an abort inside gloo, never a hang.

The model is tests/models.py's MLPStack (layers.0-2, out); normally every layer is a unit and
the root unit holds `out`. One rank deviates per case. After each case every rank runs an
all-reduce that checks the process group is still usable and in step.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from dist_utils import load_impl, run_distributed, run_grid
from models import MLPStack

HEAD = "fsdp_native: the fully_shard structure differs across ranks (checked at the first forward): "
TAIL = "; fully_shard must be called on the same modules with the same settings on every rank"
BF16 = "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=None, output_dtype=None, cast_forward_inputs=True)"
NO_MP = "MixedPrecisionPolicy(param_dtype=None, reduce_dtype=None, output_dtype=None, cast_forward_inputs=True)"

# case -> (what the odd rank does, the message every rank must raise)
EXPECTED = {
    "root_skipped": HEAD + "the first forward's root is a MLPStack with 4 units ('<root>', 'layers.0', 'layers.1', "
    "'layers.2') on ranks [0] but a Linear with 1 unit ('<root>') on ranks [1]" + TAIL,
    "root_only": HEAD + "unit 1 'layers.0' exists on ranks [0] but not on [1]; unit 2 'layers.1' exists on ranks [0] "
    "but not on [1]; unit 3 'layers.2' exists on ranks [0] but not on [1]; unit 0 '<root>': parameter "
    "'layers.0.weight' exists on ranks [1] but not on [0]; and 5 more difference(s)" + TAIL,
    "unit_missing": HEAD + "unit 2 'layers.1' exists on ranks [0] but not on [1]; unit 0 '<root>': parameter "
    "'layers.1.weight' exists on ranks [1] but not on [0]; unit 0 '<root>': parameter 'layers.1.bias' exists on "
    "ranks [1] but not on [0]" + TAIL,
    "shape": HEAD + "unit 2 'layers.1': parameter 'layers.1.weight' has shape (8, 8) on ranks [0] but (8, 9) on "
    "ranks [1]" + TAIL,
    "shape_one_unit": HEAD + "unit 0 '<root>': parameter 'layers.0.weight' has shape (8, 8) on ranks [0] but (9, 8) "
    "on ranks [1]; unit 0 '<root>': parameter 'layers.0.bias' has shape (8,) on ranks [0] but (9,) on ranks [1]; "
    "unit 0 '<root>': parameter 'layers.1.weight' has shape (8, 8) on ranks [0] but (8, 9) on ranks [1]" + TAIL,
    "dtype": HEAD + "unit 3 'layers.2': parameter 'layers.2.weight' has dtype float32 on ranks [0] but float64 on "
    "ranks [1]; unit 3 'layers.2': parameter 'layers.2.bias' has dtype float32 on ranks [0] but float64 on ranks "
    "[1]" + TAIL,
    "frozen": HEAD + "unit 1 'layers.0': parameter 'layers.0.weight' has requires_grad True on ranks [0] but False "
    "on ranks [1]" + TAIL,
    "reshard_after_forward": HEAD + "unit 1 'layers.0': reshard_after_forward is True on ranks [0] but False on ranks "
    "[1]; unit 2 'layers.1': reshard_after_forward is True on ranks [0] but False on ranks [1]; unit 3 'layers.2': "
    "reshard_after_forward is True on ranks [0] but False on ranks [1]" + TAIL,
    "root_reshard": HEAD + "unit 0 '<root>': reshard_after_forward is False on ranks [0] but True on ranks [1]" + TAIL,
    "mp_policy": HEAD + f"unit 2 'layers.1': mp_policy is {NO_MP} on ranks [0] but {BF16} on ranks [1]" + TAIL,
    "offload_policy": HEAD + "unit 3 'layers.2': offload_policy is OffloadPolicy() on ranks [0] but "
    "CPUOffloadPolicy(pin_memory=False) on ranks [1]" + TAIL,
    "shard_dim": HEAD + "unit 2 'layers.1': parameter 'layers.1.weight' is sharded on dim 0 on ranks [0] but 1 on ranks "
    "[1]" + TAIL,
    "order": HEAD + "the order of the units is ['<root>', 'layers.0', 'layers.1', 'layers.2'] on ranks [0] but "
    "['<root>', 'layers.0', 'layers.2', 'layers.1'] on ranks [1]" + TAIL,
}


class _Swapped(nn.Module):
    """MLPStack whose layers 1 and 2 are registered in the other order (same names, shapes)."""

    def __init__(self, swap: bool):
        super().__init__()
        m = MLPStack()
        self.layers = nn.Module()
        names = ["0", "2", "1"] if swap else ["0", "1", "2"]
        for n in names:
            self.layers.add_module(n, m.layers[int(n)])
        self.out = m.out

    def forward(self, x):
        for n in ("0", "1", "2"):
            x = torch.relu(getattr(self.layers, n)(x))
        return self.out(x)


def _check_group_in_step():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    ws = dist.get_world_size()
    assert t.item() == ws * (ws + 1) / 2, f"process group out of step after the error: {t.item()}"


def build(case: str, odd: bool, mesh):
    impl = load_impl()
    fs = impl.fully_shard
    torch.manual_seed(0)
    m = _Swapped(odd) if case == "order" else MLPStack()
    kw = dict(mesh=mesh)
    if odd and case == "shape":
        m.layers[1] = nn.Linear(9, 8)
    if odd and case == "shape_one_unit":
        m.layers[0] = nn.Linear(8, 9)
        m.layers[1] = nn.Linear(9, 8)
    if odd and case == "dtype":
        m.layers[2].double()
    if odd and case == "frozen":
        m.layers[0].weight.requires_grad_(False)
    if case == "shape_one_unit":
        return fs(m, **kw)
    for i, layer in enumerate(m.layers.children()):
        layer_kw = dict(kw)
        if odd and case == "reshard_after_forward":
            layer_kw["reshard_after_forward"] = False
        if odd and case == "mp_policy" and i == 1:
            layer_kw["mp_policy"] = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        if odd and case == "shard_dim" and i == 1:
            layer_kw["shard_placement_fn"] = lambda p: Shard(1) if p.dim() == 2 else None
        if odd and case == "offload_policy" and i == 2:
            layer_kw["offload_policy"] = impl.CPUOffloadPolicy(pin_memory=False)
        if odd and case in ("root_only",):
            continue
        if odd and case == "unit_missing" and i == 1:
            continue
        fs(layer, **layer_kw)
    if odd and case == "root_skipped":
        return m
    fs(m, **kw, **({"reshard_after_forward": True} if odd and case == "root_reshard" else {}))
    return m


def case(name: str, odd_rank: int = 1):
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build(name, rank == odd_rank, mesh)
    x = torch.randn(2, 8, dtype=torch.float64 if name == "dtype" and rank == odd_rank else torch.float32)
    with pytest.raises(ValueError) as info:
        model(x)
    assert str(info.value) == EXPECTED[name], f"\n got: {info.value}\nwant: {EXPECTED[name]}"
    _check_group_in_step()


def _grid():
    run_grid([dict(name=n) for n in EXPECTED], case, name="agreement")


def test_structure_mismatch_raises_on_every_rank():
    run_distributed(_grid, 2, timeout=180)


def hsdp_case(kind: str):
    """2x2 mesh (replicate, shard); rank 3 deviates: its shard group {2, 3} and, through the
    replicate groups, ranks 0 and 1 learn of it."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = build(kind, rank == 3, mesh)
    if kind == "same":
        model(torch.randn(2, 8)).sum().backward()
        _check_group_in_step()
        return
    with pytest.raises(ValueError) as info:
        model(torch.randn(2, 8))
    want = EXPECTED[kind].replace("ranks [0] but", "ranks [0, 1, 2] but").replace("on ranks [1]", "on ranks [3]")
    assert str(info.value) == want, f"\n got: {info.value}\nwant: {want}"
    _check_group_in_step()


def _hsdp_grid():
    run_grid([dict(kind=k) for k in ("same", "reshard_after_forward", "shape")], hsdp_case, name="agreement-hsdp")


def test_structure_mismatch_hsdp():
    run_distributed(_hsdp_grid, 4, timeout=240)
