"""Parameters of one ``fully_shard`` call on meshes of their own (torch 2.13+):
``shard_placement_fn`` returns a ``ShardPlacementResult`` whose ``mesh_info`` is another mesh,
as torchtitan's MoE models with expert parallelism do (one ``fully_shard`` per transformer
block: the experts on the ``efsdp`` mesh, every other parameter on the data-parallel mesh).

4 ranks. The dense parameters are sharded over all of them; the experts either

* over an HSDP mesh of their own (2 replicas x 2 shards), as plain parameters, or
* over ``efsdp`` (2 ranks) as expert-parallel DTensors (``Shard(0)`` over ``ep``, 2 ranks),
  on dim 0 or, with fewer local experts than ``efsdp`` ranks, dim 1 (torchtitan's rule), or
* as torchtitan lays out HSDP with expert parallelism at 4 ranks: the dense parameters on
  (dp_replicate 2, fsdp 2), the experts' DTensors over ``ep`` 2 on (dp_replicate 2, efsdp 1).

Losses, parameters, placements and local shapes are torch FSDP2's, bit for bit, with mixed
precision, gradient accumulation, no reshard after forward, torchtitan's gradient divide
factor of 1 and its explicit prefetch; a DCP checkpoint saved by one library loads into the
other. The setters that torch refuses with several meshes (custom all-gather and
reduce-scatter, the all-reduce hook) raise its error.
"""
from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from dist_utils import assert_same_run, full_params, load_impl, placements_of, raises_exactly, ref_impl, run_distributed, run_grid
from models import BlockStack, train_steps

_common = pytest.importorskip(
    "torch.distributed.fsdp._fully_shard._fsdp_common", reason="torch FSDP2's per-parameter mesh needs torch 2.13+"
)
if not hasattr(_common, "ShardPlacementResult"):
    pytest.skip("torch FSDP2's per-parameter mesh (ShardPlacementResult) needs torch 2.13+", allow_module_level=True)
FSDPMeshInfo, HSDPMeshInfo, ShardPlacementResult = _common.FSDPMeshInfo, _common.HSDPMeshInfo, _common.ShardPlacementResult


def _local(w):
    return w.to_local() if isinstance(w, DTensor) else w


class Experts(nn.Module):
    """torchtitan's GroupedExperts shape (experts on dim 0). With expert parallelism the weights
    are DTensors ``Shard(0)`` over ``ep`` and each rank runs its local experts on its own tokens
    (no token exchange: the numbers only have to be the same for both libraries)."""

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n_experts, dim, hidden) * 0.1)
        self.w2 = nn.Parameter(torch.randn(n_experts, hidden, dim) * 0.1)

    def forward(self, x, weights):
        w1, w2 = _local(self.w1), _local(self.w2)
        first = 0
        if isinstance(self.w1, DTensor):
            first = self.w1.device_mesh.get_local_rank() * w1.shape[0]
        weights = weights[:, first : first + w1.shape[0]]
        h = F.silu(torch.einsum("td,edh->eth", x, w1.to(x.dtype)))
        out = torch.einsum("eth,ehd->etd", h, w2.to(x.dtype))
        return torch.einsum("etd,te->td", out, weights.to(x.dtype))


class MoEBlock(nn.Module):
    def __init__(self, n_experts: int, dim: int, hidden: int, ac: bool):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = Experts(n_experts, dim, hidden)
        self.ac = ac

    def _forward(self, x):
        h = self.norm(x)
        return x + self.experts(h, torch.softmax(self.router(h).float(), dim=-1))

    def forward(self, x):
        if self.ac:  # activation checkpointing, as torchtitan applies it to its blocks
            return torch.utils.checkpoint.checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class MoE(BlockStack):
    def __init__(self, n_experts: int, ac: bool = False, dim: int = 8, hidden: int = 12, n: int = 2):
        super().__init__(lambda: MoEBlock(n_experts, dim, hidden, ac), dim, n)


def _meshes(kind: str):
    """(the dense mesh, the experts' mesh info, the expert-parallel mesh or None)."""
    if kind == "hsdp-ep":
        # torchtitan's HSDP with EP at 4 ranks: dense (dp_replicate 2, fsdp 2); experts over
        # ep 2, replicated over dp_replicate, on an efsdp dim of 1 rank
        dense = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "fsdp"))
        sparse = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp_replicate", "efsdp", "ep"))
        edp = sparse["dp_replicate", "efsdp"]
        return dense, HSDPMeshInfo(mesh=edp, replicate_mesh_dim=0, shard_mesh_dim=1), sparse["ep"]
    dense = init_device_mesh("cpu", (4,), mesh_dim_names=("fsdp",))
    if kind == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        return dense, HSDPMeshInfo(mesh=mesh, replicate_mesh_dim=0, shard_mesh_dim=1), None
    sparse = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
    return dense, FSDPMeshInfo(mesh=sparse["efsdp"], shard_mesh_dim=0), sparse["ep"]


def _build(impl, kind: str, n_experts: int = 4, mp: bool = False, reshard=True, dense_info: bool = False, titan: bool = False, ac: bool = False):
    torch.manual_seed(0)
    model = MoE(n_experts, ac)
    dense, expert_info, ep = _meshes(kind)
    if ep is not None:  # expert parallelism: the experts' weights split over ep, as torchtitan's plan does
        for b in model.blocks:
            for name, p in list(b.experts.named_parameters()):
                setattr(b.experts, name, nn.Parameter(distribute_tensor(p.detach(), ep, [Shard(0)])))
    kw = dict(mesh=dense)
    if mp:
        kw["mp_policy"] = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    dense_info = dense_info and (
        FSDPMeshInfo(mesh=dense, shard_mesh_dim=0) if dense.ndim == 1 else HSDPMeshInfo(mesh=dense, replicate_mesh_dim=0, shard_mesh_dim=1)
    )
    dense_result = ShardPlacementResult(placement=Shard(0), mesh_info=dense_info) if dense_info else None
    for b in model.blocks:
        experts = set(b.experts.parameters())
        local_experts = _local(b.experts.w1).shape[0]
        placement = Shard(1) if expert_info.shard_mesh_size > local_experts else Shard(0)

        def fn(p, experts=experts, placement=placement):
            if p in experts:
                return ShardPlacementResult(placement=placement, mesh_info=expert_info)
            return dense_result

        impl.fully_shard(b, reshard_after_forward=reshard, shard_placement_fn=fn, **kw)
    impl.fully_shard(model, **kw)
    if titan:
        # torchtitan: no gradient division by FSDP (the loss is scaled by the global token
        # count instead; on a backend without PREMUL_SUM, such as gloo, with sum reductions),
        # explicit forward and backward prefetch between the blocks
        for m in model.modules():
            if isinstance(m, impl.FSDPModule):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
        blocks = list(model.blocks)
        for a, b in zip(blocks, blocks[1:]):
            a.set_modules_to_forward_prefetch([b])
            b.set_modules_to_backward_prefetch([a])
    return model


def _meshes_of(model) -> dict:
    """Each parameter's mesh: its ranks and dim names."""
    return {n: (p.device_mesh.mesh.tolist(), p.device_mesh.mesh_dim_names) for n, p in model.named_parameters()}


def _train(impl, kind, accum=1, **kw) -> dict:
    model = _build(impl, kind, **kw)
    meshes = _meshes_of(model)
    losses = train_steps(model, steps=3, accum=accum)
    return dict(losses=losses, params=full_params(model), placements=placements_of(model), meshes=meshes, model=model)


def check_parity(kind: str, **kw) -> None:
    impl, torch_impl = load_impl(), ref_impl()
    b = _train(torch_impl, kind, **kw)
    a = _train(impl, kind, **kw)
    assert a["placements"] == b["placements"], f"{a['placements']} vs torch {b['placements']}"
    assert a["meshes"] == b["meshes"], f"{a['meshes']} vs torch {b['meshes']}"
    assert a["meshes"]["blocks.0.experts.w1"] != a["meshes"]["blocks.0.router.weight"], a["meshes"]
    assert_same_run(f"[{impl.name} vs torch] {kind} {kw}", a, b)
    if kind == "ep" and not kw.get("mp"):
        _check_checkpoint(a["model"], b["model"])


def _check_checkpoint(a: nn.Module, b: nn.Module) -> None:
    """A DCP checkpoint of one library's model loads into the other's (sharded on other meshes
    per parameter), both ways."""
    path = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)
    for src, dst, tag in ((a, b, "a"), (b, a, "b")):
        want = full_params(src)
        dcp.save(src.state_dict(), checkpoint_id=f"{path[0]}/{tag}")
        with torch.no_grad():
            for p in dst.parameters():
                _local(p).zero_()
        sd = dst.state_dict()
        dcp.load(sd, checkpoint_id=f"{path[0]}/{tag}")
        dst.load_state_dict(sd)
        got = full_params(dst)
        for n in want:
            assert torch.equal(got[n], want[n]), f"checkpoint {tag}: {n}"


class _Comm:
    """A torch Comm object (never called: the setters refuse it)."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, **kwargs):
        return None


def _error(fn) -> tuple[type, str]:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - compared with torch's below
        return type(e), str(e)
    return type(None), "nothing raised"


def check_errors() -> None:
    """What torch refuses for a module whose parameters are on several meshes, fsdp_native refuses
    with torch's error; and an int reshard_after_forward that would reshard the experts' mesh to a
    smaller group, which fsdp_native does not support, raises on every rank."""
    impl, torch_impl = load_impl(), ref_impl()
    models = {lib.name: _build(lib, "hsdp") for lib in (impl, torch_impl)}
    for method, arg in (("set_custom_all_gather", _Comm()), ("set_custom_reduce_scatter", _Comm()), ("set_all_reduce_hook", lambda t: None)):
        ours = _error(lambda: getattr(models[impl.name].blocks[0], method)(arg))
        theirs = _error(lambda: getattr(models[torch_impl.name].blocks[0], method)(arg))
        assert theirs[0] is ValueError, theirs
        assert ours == theirs, f"{method}: {ours} vs torch {theirs}"
    if impl.name != "fsdp_native":
        return
    block = MoEBlock(4, 8, 12, ac=False)
    # HSDP with one replica: the experts' 4 shard ranks, on a mesh other than the call's
    info = HSDPMeshInfo(mesh=init_device_mesh("cpu", (1, 4), mesh_dim_names=("r", "s")), replicate_mesh_dim=0, shard_mesh_dim=1)
    experts = set(block.experts.parameters())
    raises_exactly(
        NotImplementedError,
        "fully_shard: argument 'reshard_after_forward' is 2, which would reshard parameters on a mesh of their own "
        "('experts.w1', 'experts.w2', 4 shard ranks) to a smaller group after forward; fsdp_native supports that on "
        "the call's mesh only",
        lambda: impl.fully_shard(
            block,
            mesh=init_device_mesh("cpu", (4,)),
            reshard_after_forward=2,
            shard_placement_fn=lambda p: ShardPlacementResult(placement=Shard(0), mesh_info=info) if p in experts else None,
        ),
    )
    # The module's memory statistics sum its units on both meshes.
    model = models[impl.name]
    model.blocks[0].unshard()
    stats = impl.unsharded_stats(model).units["blocks.0"]
    want = sum(p.numel() * 4 for p in model.blocks[0].parameters())  # fp32, registered unsharded
    # (each unit's buffer pads its parameters a little: at least their bytes, on both meshes)
    assert stats.current_bytes == stats.unsharded_bytes >= want, (stats, want)
    model.blocks[0].reshard()


def _grid():
    configs = [
        dict(kind="hsdp"),
        dict(kind="ep", dense_info=True, titan=True),
        dict(kind="ep", n_experts=2, mp=True, accum=2),  # 1 local expert, 2 efsdp ranks: Shard(1)
        dict(kind="hsdp", mp=True, reshard=False, titan=True, ac=True),
        dict(kind="ep", reshard=2, ac=True),  # dense: 2 ranks after forward; experts: all 2 of efsdp
        dict(kind="hsdp-ep", dense_info=True, mp=True, accum=2, titan=True),
    ]
    run_grid(configs, check_parity, name="per-param-mesh")
    run_grid([{}], check_errors, name="per-param-mesh-errors")


def test_per_param_mesh_matches_torch():
    run_distributed(_grid, 4, timeout=400)
