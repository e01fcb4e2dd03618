"""Parameters that tensor (or expert) parallelism made DTensors before ``fully_shard``: FSDP
over a data-parallel mesh composed with TP over another dim of the same device mesh
(``init_device_mesh(..., ("dp", "tp"))``, ``parallelize_module(model, mesh["tp"], plan)``,
then ``fully_shard(..., mesh=mesh["dp"])``), as torch FSDP2 composes them.

The unit packs, gathers and reduces each such parameter's TP-local tensor as it would a plain
parameter. At the edges:

* the sharded parameter is a DTensor on the data-parallel and TP meshes concatenated, placed
  ``(Shard(d), *tp placements)`` (``Replicate()`` first with HSDP), its global shape the TP
  DTensor's; where TP shards the same dim, FSDP's dim is a ``_StridedShard`` of split factor
  the TP shards of that dim, since the local tensor FSDP chunks is itself a TP chunk;
* the unsharded parameter is a DTensor with the TP spec over the gathered local tensor (in
  ``param_dtype``), so the TP plan's hooks see what they placed;
* its gradient is redistributed to the TP placements (a ``Partial`` one, from a replicated
  parameter used on sharded activations, is all-reduced over TP) and its local tensor reduced;
  gradients accumulated without sync stay DTensors until then, so a ``Partial`` one is
  all-reduced once, in the accumulation dtype, as torch FSDP2 does.

The SPMD form (torch 2.13's ``dp_mesh_dims``) is the same with one mesh throughout: every
parameter is a DTensor on the full mesh, ``Replicate()`` on its data-parallel dims (:class:`Spmd`);
the sharded parameter takes ``Shard(d)`` (or ``_StridedShard``, counting the shards of dim d on the
mesh dims after it) on the shard dim, and the gradient keeps what it has on the data-parallel
dims (a ``Partial`` there is the reduce-scatter's to sum).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Partial, _StridedShard

from fsdp_native import _compat, _extension
from fsdp_native._mesh import mesh_info


@dataclass(frozen=True)
class Spmd:
    """``dp_mesh_dims`` resolved: the full mesh and the indices of its shard dim and (HSDP)
    replicate dim."""

    mesh: DeviceMesh
    shard: int
    replicate: int | None

    @property
    def dp_dims(self) -> tuple[int, ...]:
        return (self.shard,) if self.replicate is None else (self.replicate, self.shard)


def spmd_mesh_info(mesh, dims):
    """(the unit's MeshInfo, :class:`Spmd`) for ``fully_shard(mesh=mesh, dp_mesh_dims=dims)``: the
    data-parallel mesh is ``mesh[shard]``, or ``mesh[replicate]`` and ``mesh[shard]`` (HSDP)."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard: argument 'mesh' must be a DeviceMesh with dp_mesh_dims, got {type(mesh).__name__}")
    if not (hasattr(dims, "shard_names") and hasattr(dims, "replicate_names")):
        raise TypeError(f"fully_shard: argument 'dp_mesh_dims' must be a DataParallelMeshDims, got {type(dims).__name__}")
    if mesh.mesh_dim_names is None:
        raise ValueError("fully_shard: argument 'mesh' must have mesh_dim_names when dp_mesh_dims is given")
    shard, replicate = tuple(dims.shard_names), tuple(dims.replicate_names)
    for name in shard + replicate:
        if name not in mesh.mesh_dim_names:
            raise ValueError(f"fully_shard: argument 'dp_mesh_dims' names mesh dim {name!r}, not in the mesh's {mesh.mesh_dim_names}")
    if not shard:
        raise NotImplementedError("fully_shard: argument 'dp_mesh_dims' without shard dims (replication only) is not supported by fsdp_native")
    if len(shard) > 1 or len(replicate) > 1:
        raise NotImplementedError(
            f"fully_shard: argument 'dp_mesh_dims' names several shard or replicate dims ({shard}, {replicate}); "
            "fsdp_native takes one of each (flatten them into one mesh dim first)"
        )
    names = mesh.mesh_dim_names
    spmd = Spmd(mesh, names.index(shard[0]), names.index(replicate[0]) if replicate else None)
    dp = mesh[shard[0]] if not replicate else _compat.concatenate_meshes([mesh[replicate[0]], mesh[shard[0]]])
    return mesh_info(dp), spmd


def split(params: list, names: list[str], info, post_forward: bool, spmd: Spmd | None = None) -> tuple[list, list]:
    """(the parameters with each TP DTensor replaced by a plain parameter over its local
    tensor, the TP specs: None for a plain parameter). Checks what fsdp_native composes with."""
    out, specs = [], []
    for p, name in zip(params, names):
        if not isinstance(p, DTensor):
            if spmd is not None:
                raise ValueError(
                    f"fully_shard: parameter '{name}' is a plain tensor; with dp_mesh_dims every parameter must be a "
                    f"DTensor on the mesh {spmd.mesh} (e.g. by distribute_module)"
                )
            out.append(p)
            specs.append(None)
            continue
        spec = p._spec
        where = f"fully_shard: parameter '{name}' is a DTensor on mesh {spec.mesh}"
        if spmd is not None:
            if spec.mesh != spmd.mesh:
                raise ValueError(f"{where}, expected the mesh given to fully_shard with dp_mesh_dims, {spmd.mesh}")
            wrong = [i for i in spmd.dp_dims if not isinstance(spec.placements[i], Replicate)]
            if wrong:
                raise ValueError(
                    f"{where} with placements {tuple(spec.placements)}, expected Replicate() on the data-parallel dims "
                    f"{tuple(spmd.mesh.mesh_dim_names[i] for i in spmd.dp_dims)}"
                )
        elif spec.mesh.device_type != info.mesh.device_type:
            raise ValueError(f"{where} of device type {spec.mesh.device_type!r}, expected the data-parallel mesh's {info.mesh.device_type!r}")
        else:
            spmd_mesh(info.mesh, spec.mesh, where)  # raises for meshes that do not compose
        bad = [pl for pl in spec.placements if isinstance(pl, Partial) or not isinstance(pl, (Shard, Replicate))]
        if bad:
            raise ValueError(f"{where} with placements {tuple(spec.placements)}, expected Shard or Replicate placements only")
        if post_forward:
            raise NotImplementedError(
                f"{where}: an int reshard_after_forward (resharding to a smaller mesh after forward) is not supported "
                "for tensor-parallel parameters, as in torch FSDP2; pass a bool"
            )
        # A tensor-subclass local tensor (torchao's Float8 weights under its Float8 TP styles)
        # keeps its all-gather extensions: the unit gathers it over the data-parallel mesh.
        local = p._local_tensor
        if spmd is not None and _extension.has_extension(local):
            raise NotImplementedError(
                f"{where} whose local tensor is a {type(local).__name__} with all-gather extensions; fsdp_native "
                "composes dp_mesh_dims with plain local tensors only (tensor parallelism on a mesh of its own "
                "composes with them)"
            )
        out.append(nn.Parameter(local.detach(), requires_grad=p.requires_grad))
        specs.append(spec)
    return out, specs


def spmd_mesh(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh, where: str = "fully_shard") -> DeviceMesh:
    """The data-parallel mesh's dims followed by the TP mesh's, one mesh (as torch FSDP2 builds
    it, per parameter); both must come from one device mesh and not overlap. Not cached: meshes
    compare by layout, and a cached one could carry the process groups of a destroyed world."""
    if dp_mesh.mesh_dim_names is None or tp_mesh.mesh_dim_names is None:
        raise ValueError(
            f"{where}: the data-parallel mesh and the tensor-parallel mesh must be named dims of one device mesh "
            "(init_device_mesh(..., mesh_dim_names=...), then mesh['dp'] and mesh['tp'])"
        )
    try:
        return _compat.concatenate_meshes([dp_mesh, tp_mesh])
    except RuntimeError as e:
        raise ValueError(
            f"{where} that does not compose with the data-parallel mesh {dp_mesh}: {e}; expected the TP mesh and "
            "the data-parallel mesh to be distinct dims of one device mesh (a parameter sharded by another "
            "fully_shard cannot be sharded again)"
        ) from None


def placements(spec: DTensorSpec, info, dim: int, spmd: Spmd | None = None) -> tuple:
    """The sharded parameter's placements on :func:`spmd_mesh`, or on the SPMD mesh."""
    if spmd is not None:
        pls = list(spec.placements)
        split_factor = math.prod(
            spmd.mesh.size(j) for j in range(spmd.shard + 1, spmd.mesh.ndim) if isinstance(pls[j], Shard) and pls[j].dim == dim
        )
        pls[spmd.shard] = _fsdp_placement(dim, split_factor)
        return tuple(pls)
    return (*info.placements[:-1], _fsdp_placement(dim, spec.num_shards_map[dim]), *spec.placements)


def _fsdp_placement(dim: int, split_factor: int):
    """FSDP's placement of a dim that `split_factor` shards of other mesh dims already split."""
    return _StridedShard(dim, split_factor=split_factor) if split_factor > 1 else Shard(dim)


def unsharded(local: torch.Tensor, spec: DTensorSpec, requires_grad: bool) -> nn.Parameter:
    """The unsharded parameter: `local` (the gathered TP-local tensor) with the TP spec."""
    meta = spec.tensor_meta
    if meta is not None and meta.dtype != local.dtype:
        spec = dataclasses.replace(spec, tensor_meta=TensorMeta(meta.shape, meta.stride, local.dtype))
    p = nn.Parameter(DTensor(local, spec, requires_grad=False), requires_grad=requires_grad)
    p._local_tensor = local  # Parameter() detached a copy of the wrapper: point it back at the view
    return p


def may_reduce_outside_dp(spec: DTensorSpec, spmd: Spmd | None) -> bool:
    """Whether the gradient of a parameter with these TP placements may be ``Partial`` outside
    the data-parallel dims (a ``Replicate`` placement there), to be reduced over TP."""
    dp = () if spmd is None else spmd.dp_dims
    return any(isinstance(pl, Replicate) for i, pl in enumerate(spec.placements) if i not in dp)


def local_grad(grad, spec: DTensorSpec, spmd: Spmd | None = None) -> torch.Tensor:
    """The local tensor of an unsharded parameter's gradient, in the parameter's TP placements
    (with SPMD: on the dims that are not data parallel; the data-parallel dims keep the
    gradient's). From torch 2.15 a parameter with a ``Replicate`` TP placement (whose gradient
    may be ``Partial``) has its gradient in the reduce dtype already, so that the TP reduction
    runs in it: its ``grad_dtype`` (``Unit._init_grad_dtypes``)."""
    dp = () if spmd is None else spmd.dp_dims
    target = tuple(grad.placements[i] if i in dp else pl for i, pl in enumerate(spec.placements))
    if tuple(grad.placements) != target:
        grad = grad.redistribute(placements=target)
    local = grad._local_tensor
    return local.wait() if isinstance(local, AsyncCollectiveTensor) else local
