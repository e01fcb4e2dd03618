"""The torch-version shims of ``fsdp_native._compat``, on whatever torch is installed (CI runs
this file on torch 2.9, 2.11, 2.13 and 2.15: ``make test-older``, ``test-oldest``, ``test``,
``test-newest``).

* ``all_gather_single`` / ``reduce_scatter_single`` gather and reduce as the collectives do
  (2 gloo ranks, sum and average), whichever torch name is underneath, and look the name up
  on ``torch.distributed`` at call time (a wrapper installed there sees the call).
* ``DTENSOR_SUBCLASS_DISPATCH`` matches what this torch does: a DTensor subclass's own
  ``__torch_dispatch__`` is called, or is not.
* torch 2.15's ``param_dtype_override_fn`` and ``reduce_dtype=None`` rule: ``tests/test_mp_override.py``.
* ``nn.Parameter`` of a ShardedDTensor is a ShardedDTensor (2.10 and 2.11 returned a plain
  DTensor from ``detach`` and refused), and the optimizer ops on it and its gradient stay
  ShardedDTensors; ``new_dtensor`` makes the wrapper on every version.
* ``concatenate_meshes``: a 2 x 2 mesh's two dims as one mesh, with the mesh's ranks and process
  groups, and RuntimeError for a dim concatenated with itself (meshes that overlap).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from dist_utils import run_distributed
from models import Cfg, make_mesh


def test_version_parsing():
    from fsdp_native._compat import _version

    assert _version("2.11.0+cu130") == (2, 11)
    assert _version("2.13.0") == (2, 13)
    assert _version("2.16.0.dev20260101+cpu") == (2, 16)


def _collectives_body():
    from fsdp_native import _compat

    rank = dist.get_rank()
    n = 5
    shard = torch.arange(n, dtype=torch.float32) + 10 * rank
    out = torch.full((2 * n,), float("nan"))
    _compat.all_gather_single(out, shard)
    assert torch.equal(out, torch.cat([torch.arange(n) + 0.0, torch.arange(n) + 10.0])), out

    work = _compat.all_gather_single(out.zero_(), shard, async_op=True)
    work.wait()
    assert torch.equal(out, torch.cat([torch.arange(n) + 0.0, torch.arange(n) + 10.0])), out

    inp = torch.arange(2 * n, dtype=torch.float32) * (rank + 1)  # rank 0: x, rank 1: 2x
    got = torch.empty(n)
    _compat.reduce_scatter_single(got, inp, op=dist.ReduceOp.SUM, async_op=True).wait()
    assert torch.equal(got, 3 * torch.arange(rank * n, (rank + 1) * n, dtype=torch.float32)), got
    _compat.reduce_scatter_single(got, inp, op=dist.ReduceOp.AVG, group=dist.group.WORLD)
    assert torch.equal(got, 1.5 * torch.arange(rank * n, (rank + 1) * n, dtype=torch.float32)), got

    # looked up on torch.distributed at call time
    name = _compat._ALL_GATHER
    calls = []
    orig = getattr(dist, name)
    setattr(dist, name, lambda *a, **k: calls.append(1) or orig(*a, **k))
    try:
        _compat.all_gather_single(out, shard)
    finally:
        setattr(dist, name, orig)
    assert calls == [1], f"dist.{name} was not called through at call time"


def test_collective_shims_ws2():
    run_distributed(_collectives_body, 2)


def _dispatch_body():
    from fsdp_native import _compat
    from fsdp_native._compat import DTENSOR_SUBCLASS_DISPATCH
    from fsdp_native._dtensor import ShardedDTensor, make_sharded

    mesh = make_mesh(Cfg())
    local = torch.randn(3, 4)
    plain = DTensor.from_local(local, mesh, (Shard(0),), run_check=False)

    seen = []

    class Seen(Exception):
        pass

    class Probe(DTensor):
        __slots__ = ()

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            seen.append(func)
            raise Seen  # called: that is all this probe asks

    probe = _compat.new_dtensor(Probe, local, plain._spec, requires_grad=False)
    probe._local_tensor = local
    try:
        probe.detach()
    except Seen:
        pass
    assert bool(seen) == DTENSOR_SUBCLASS_DISPATCH, f"torch {torch.__version__}: subclass dispatch called: {seen}"

    p = nn.Parameter(make_sharded(local.clone(), plain._spec), requires_grad=True)
    assert type(p) is ShardedDTensor and isinstance(p, nn.Parameter) and p.requires_grad
    p.grad = make_sharded(torch.ones(3, 4), p._spec)
    with torch.no_grad():
        state = torch.zeros_like(p, memory_format=torch.preserve_format)
        state.lerp_(p.grad, 0.1)
        p.add_(state / (state.sqrt() + 1e-8), alpha=-0.5)
    assert type(state) is ShardedDTensor and state._spec is p._spec
    assert type(p.detach()) is ShardedDTensor
    expected = local - 0.5 * (0.1 / (0.1**0.5 + 1e-8))
    torch.testing.assert_close(p.to_local(), expected, rtol=0, atol=1e-6)
    # ops that change the spec are DTensor's and give a plain DTensor
    assert type(p.sum()) is DTensor


def test_sharded_dtensor_dispatch_ws2():
    run_distributed(_dispatch_body, 2)


def _mesh_body():
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_native import _compat

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    both = _compat.concatenate_meshes([mesh["dp"], mesh["tp"]])
    assert both.mesh_dim_names == ("dp", "tp"), both.mesh_dim_names
    assert torch.equal(both.mesh, mesh.mesh), (both.mesh, mesh.mesh)
    # its process groups are the mesh's: a collective over each dim sums over that dim's ranks
    rank = dist.get_rank()
    for dim, peers in (("dp", mesh.mesh[:, rank % 2]), ("tp", mesh.mesh[rank // 2])):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=both.get_group(dim))
        assert t.item() == float(peers.sum()), (dim, t, peers)

    try:
        _compat.concatenate_meshes([mesh["dp"], mesh["dp"]])
    except RuntimeError:
        pass
    else:
        raise AssertionError("a mesh dim was concatenated with itself")


def test_concatenate_meshes_ws4():
    run_distributed(_mesh_body, 4)
