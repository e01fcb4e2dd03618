"""``fully_shard(..., mesh=full_mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))`` (torch
2.13's SPMD form): every parameter is a DTensor on the full mesh, ``Replicate()`` on the
data-parallel dims and tensor parallel on the others, and the inputs are DTensors sharded over
"dp". 4 gloo ranks as ("dp", "tp") = (2, 2), and as ("rep", "dp") = (2, 2) for HSDP.

* **Against torch FSDP2** (torch 2.13 and later): losses and every rank's local shards bit for
  bit, with the same placements (``_StridedShard`` on "dp" where "tp" shards the same dim).
* **Against the unsharded model** on every torch version (fsdp_native brings
  ``DataParallelMeshDims`` where torch lacks it), with SGD (Adam would hide a gradient scale):
  each rank's shard equals the matching chunk, and the placements are the expected ones. As in
  torch, the gradient of a loss averaged over the dp-sharded batch comes as a Partial sum that
  the reduce-scatter averages again: the unsharded model's gradient divided by the
  data-parallel size, or exactly it with ``set_gradient_divide_factor(1.0)``.
* **Errors**, on every rank: a plain parameter, a parameter not replicated on "dp", several
  shard dims, replication only, a local tensor with all-gather extensions.
"""
from __future__ import annotations

import gc

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from dist_utils import _clear_dtensor_caches, assert_close, load_impl, raises_exactly, ref_impl, run_distributed, run_grid

EXACT = dict(rtol=0, atol=0)
DP_RANKS = {False: 2, True: 4}  # data-parallel ranks the batch is sharded over ("dp"; "rep" x "dp")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.w1 = nn.Linear(16, 32)
        self.w2 = nn.Linear(32, 16)

    def forward(self, x):
        return x + self.w2(torch.relu(self.w1(self.norm(x))))


# Per parameter of a block, its placement on "tp" (column- then row-wise).
TP = {"w1.weight": Shard(0), "w1.bias": Shard(0), "w2.weight": Shard(1)}


def _dims_cls(impl):
    import torch.distributed.fsdp as tfsdp

    return impl.module.DataParallelMeshDims if impl.name == "fsdp_native" else tfsdp.DataParallelMeshDims


def _distribute(model, mesh, hsdp: bool) -> None:
    for b in model:
        for n, p in list(b.named_parameters()):
            owner, attr = n.rsplit(".", 1)
            pl = (Replicate(), Replicate()) if hsdp else (Replicate(), TP.get(n, Replicate()))
            setattr(b.get_submodule(owner), attr, nn.Parameter(distribute_tensor(p.detach(), mesh, pl)))


def _mesh(hsdp: bool):
    # A new mesh per configuration; DTensor's caches would give its parameters an earlier,
    # equal mesh, which torch's identity check refuses.
    _clear_dtensor_caches()
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "dp") if hsdp else ("dp", "tp"))


def _opt(params, sgd: bool):
    # SGD for the comparison with the unsharded model: Adam would hide a wrong gradient scale.
    return torch.optim.SGD(params, lr=0.1) if sgd else torch.optim.AdamW(params, lr=1e-2)


def _run(impl, mesh, hsdp: bool, mp: bool, steps: int = 3, sgd: bool = False, sum_grads: bool = False):
    """Both libraries get the same mesh object: torch checks that the parameters' mesh *is* the
    one given, and DTensor's sharding cache may hand a second, equal mesh's parameters the
    first one's."""
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    _distribute(model, mesh, hsdp)
    dims = _dims_cls(impl)(shard="dp", replicate="rep") if hsdp else _dims_cls(impl)(shard="dp")
    kw = dict(mesh=mesh, dp_mesh_dims=dims)
    if mp:
        kw["mp_policy"] = impl.mp(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for b in model:
        impl.fully_shard(b, **kw)
    impl.fully_shard(model, **kw)
    if sum_grads:  # the Partial sums summed, not averaged: the unsharded model's gradients
        for b in model:  # the method sets the module's own unit only
            b.set_gradient_divide_factor(1.0)
    opt = _opt(model.parameters(), sgd)
    batch = (Shard(0), Shard(0)) if hsdp else (Shard(0), Replicate())
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = distribute_tensor(torch.randn(8, 4, 16, generator=gen), mesh, batch)
        loss = model(x).float().pow(2).mean()
        # The cyclic garbage collector between forward and backward, as it may run anywhere:
        # on torch 2.9 it once cleared a marked DTensor input that only the graph still held.
        gc.collect()
        loss.backward()
        losses.append(loss.full_tensor().item())
        opt.step()
        opt.zero_grad()
    locals_ = {n: (p.to_local().detach().clone(), tuple(p.placements), tuple(p.shape)) for n, p in model.named_parameters()}
    return losses, locals_


def parity(hsdp: bool, mp: bool, sum_grads: bool = False) -> None:
    impl = load_impl()
    what = f"[{impl.name}] hsdp={hsdp} mp={mp} sum_grads={sum_grads}"
    mesh = _mesh(hsdp)
    losses, got = _run(impl, mesh, hsdp, mp, sum_grads=sum_grads)
    import torch.distributed.fsdp as tfsdp

    # torch 2.13 and later; not with a divide factor, for which torch needs PREMUL_SUM, which gloo lacks
    if hasattr(tfsdp, "DataParallelMeshDims") and not sum_grads:
        ref_losses, ref = _run(ref_impl(), mesh, hsdp, mp, sum_grads=sum_grads)
        assert_close(f"{what}: losses", losses, ref_losses, EXACT)
        for n in ref:
            assert got[n][1:] == ref[n][1:], f"{what}: {n}: placements, shape {got[n][1:]} vs torch's {ref[n][1:]}"
            assert_close(f"{what}: {n}", got[n][0], ref[n][0], EXACT)
    if mp:
        return
    # The unsharded model on the whole batch.
    losses, got = _run(impl, mesh, hsdp, mp, sgd=True, sum_grads=sum_grads)
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    opt = _opt(model.parameters(), True)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        loss = model(torch.randn(8, 4, 16, generator=gen)).pow(2).mean()
        assert_close(f"{what}: loss {step} vs unsharded", torch.tensor(losses[step]), loss.detach(), dict(rtol=1e-5, atol=1e-7))
        # As with torch FSDP2: the gradient of a mean over the batch sharded on the data-parallel
        # dims comes as a Partial sum over them, which the reduce-scatter averages again.
        (loss if sum_grads else loss / DP_RANKS[hsdp]).backward()
        opt.step()
        opt.zero_grad()
    full = dict(model.named_parameters())
    for n, (_, placements, _) in got.items():  # FSDP's dim strided where "tp" shards dim 0 too
        leaf = n.split(".", 1)[1]
        want = [("Replicate", None, None), ("Shard", 0, None)] if hsdp else [
            ("_StridedShard", 0, 2) if TP.get(leaf) == Shard(0) else ("Shard", 0, None),
            (type(TP.get(leaf, Replicate())).__name__, getattr(TP.get(leaf), "dim", None), None),
        ]
        seen = [(type(pl).__name__, getattr(pl, "dim", None), getattr(pl, "split_factor", None)) for pl in placements]
        assert seen == want, f"{what}: {n}: placements {seen}, expected {want}"
    coord = mesh.get_coordinate()
    for n, (local, placements, _) in got.items():
        want = full[n].detach()
        for m in reversed(range(2)):  # the inner mesh dim chunks first: FSDP shards what TP left
            pl = placements[m]
            if isinstance(pl, Shard) or type(pl).__name__ == "_StridedShard":
                want = want.chunk(2, dim=pl.dim)[coord[m]]
        assert_close(f"{what}: {n} vs unsharded", local, want, dict(rtol=1e-5, atol=1e-6))


def errors() -> None:
    impl = load_impl()
    if impl.name != "fsdp_native":
        return
    dims = impl.module.DataParallelMeshDims
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    raises_exactly(
        ValueError,
        f"fully_shard: parameter 'weight' is a plain tensor; with dp_mesh_dims every parameter must be a DTensor on the "
        f"mesh {mesh} (e.g. by distribute_module)",
        lambda: impl.fully_shard(nn.Linear(4, 4), mesh=mesh, dp_mesh_dims=dims(shard="dp")),
    )
    lin = nn.Linear(4, 4, bias=False)
    lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, (Shard(0), Replicate())))
    raises_exactly(
        ValueError,
        f"fully_shard: parameter 'weight' is a DTensor on mesh {mesh} with placements (Shard(dim=0), Replicate()), "
        "expected Replicate() on the data-parallel dims ('dp',)",
        lambda: impl.fully_shard(lin, mesh=mesh, dp_mesh_dims=dims(shard="dp")),
    )
    raises_exactly(
        NotImplementedError,
        "fully_shard: argument 'dp_mesh_dims' names several shard or replicate dims (('dp', 'tp'), ()); fsdp_native "
        "takes one of each (flatten them into one mesh dim first)",
        lambda: impl.fully_shard(nn.Linear(4, 4), mesh=mesh, dp_mesh_dims=dims(shard=("dp", "tp"))),
    )
    raises_exactly(
        NotImplementedError,
        "fully_shard: argument 'dp_mesh_dims' without shard dims (replication only) is not supported by fsdp_native",
        lambda: impl.fully_shard(nn.Linear(4, 4), mesh=mesh, dp_mesh_dims=dims(replicate="dp")),
    )
    raises_exactly(
        ValueError,
        "fully_shard: argument 'dp_mesh_dims' names mesh dim 'x', not in the mesh's ('dp', 'tp')",
        lambda: impl.fully_shard(nn.Linear(4, 4), mesh=mesh, dp_mesh_dims=dims(shard="x")),
    )
    # a local tensor with torch's all-gather extensions (torchao's Float8 weights are such)
    lin = nn.Linear(4, 4, bias=False)
    local = torch.Tensor._make_subclass(_WithExtensions, lin.weight.detach())
    lin.weight = nn.Parameter(DTensor.from_local(local, mesh, (Replicate(), Replicate()), run_check=False))
    lin.weight._local_tensor = local  # Parameter() detached it to a plain tensor (no __torch_dispatch__ here)
    raises_exactly(
        NotImplementedError,
        f"fully_shard: parameter 'weight' is a DTensor on mesh {mesh} whose local tensor is a _WithExtensions with all-gather "
        "extensions; fsdp_native composes dp_mesh_dims with plain local tensors only (tensor parallelism on a mesh of its "
        "own composes with them)",
        lambda: impl.fully_shard(lin, mesh=mesh, dp_mesh_dims=dims(shard="dp")),
    )


class _WithExtensions(torch.Tensor):
    """A tensor subclass that declares torch's all-gather extension protocol."""

    def fsdp_pre_all_gather(self, mesh):
        return (self.as_subclass(torch.Tensor),), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        return outputs[0], ()


def _grid() -> None:
    configs = [dict(hsdp=False, mp=False), dict(hsdp=False, mp=True), dict(hsdp=True, mp=False)]
    configs += [dict(hsdp=False, mp=False, sum_grads=True), dict(hsdp=True, mp=False, sum_grads=True)]
    run_grid(configs, parity, "spmd")
    run_grid([{}], errors, "spmd-errors")


def test_dp_mesh_dims():
    run_distributed(_grid, 4)
