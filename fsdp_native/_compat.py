"""Differences between the supported torch versions (2.9 to 2.15), in one place.

Each shim says which versions need it; everything else in fsdp_native is written for torch
2.13's API and behaves the same on every supported version (the tests run on 2.9, 2.11, 2.13
and 2.15, CI builds the CUDA kernels against the newest).

* ``all_gather_single`` / ``reduce_scatter_single``: torch 2.13 renamed
  ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to these names (the old names still
  work there, deprecated). Before 2.13 there are only the old names. The name is looked up on
  ``torch.distributed`` at every call, so a wrapper installed on ``torch.distributed`` (as
  ``benchmarks/bench_overlap.py`` does) sees fsdp_native's collectives.
* ``new_dtensor``: the DTensor wrapper over a local tensor. torch 2.10 has a C++ constructor
  for it (``torch.Tensor._dtensor__new__``); 2.9 makes it with ``torch.Tensor._make_dtensor``.
* ``concatenate_meshes``: the data-parallel and tensor-parallel dims as one mesh
  (``DeviceMesh._concatenate`` from 2.10; on 2.9, as its FSDP2 does, the root mesh sliced by
  the dims' names).
* ``DTENSOR_SUBCLASS_DISPATCH``: on torch 2.9 (Python DTensor dispatch) and from 2.12 an op on
  a DTensor subclass that overrides ``__torch_dispatch__`` goes to that override; 2.10 and 2.11
  send every DTensor subclass straight to DTensor's C++ dispatch, so
  ``ShardedDTensor.__torch_dispatch__`` was never called and every op returned a plain DTensor
  (``nn.Parameter(ShardedDTensor)`` failed on ``detach``). ``fsdp_native._dtensor`` routes
  ShardedDTensor's ops to its dispatch by other means where this is False.
* ``REDUCE_IN_ORIG_DTYPE``: torch 2.15 changed what ``MixedPrecisionPolicy(reduce_dtype=None)``
  means. Before, gradients were reduced in ``param_dtype``; from 2.15 in the parameters'
  original dtype (their ``grad_dtype``): fp32 for fp32 parameters computed in bf16. Gradients
  accumulated with gradient sync off follow the same dtype. fsdp_native does what the
  installed torch's FSDP2 does, so its numbers stay torch's on each version.
* ``GRAD_IN_REDUCE_DTYPE``: from torch 2.15 (not 2.14) FSDP2 sets the ``grad_dtype`` of each
  unsharded parameter to the policy's ``reduce_dtype``, else the parameter's original dtype,
  and autograd hands over the gradients in it. Where that is wider than the compute dtype
  (bf16 compute, fp32 reduce), torch lifts it (``None``) during every backward that reduces or
  adds to a gradient already there, and restores it after. So an op whose backward makes
  fp32 gradients for bf16 weights (the CPU LSTM's) keeps them, where before 2.15 autograd
  rounded them to bf16; and in the first backward without gradient sync, a parameter used
  several times (a layer applied twice, an RNN's recurrent weight) has its contributions
  summed in fp32, where every other backward sums them in bf16. A reduce dtype narrower than
  the compute dtype (fp32 compute, bf16 reduction) is never lifted: each contribution is cast
  to bf16 before the sum. ``Unit.defer_grad_upcast`` and
  ``Unit.restore_grad_dtypes`` do the same, so the gradients are torch's bit for bit. A
  tensor-parallel parameter with a ``Replicate`` placement, whose gradient may be ``Partial``
  over TP, keeps the wide dtype throughout, so the TP all-reduce of that gradient runs in fp32
  for bf16 compute (before 2.15, in the compute dtype).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _version(v: str) -> tuple[int, int]:
    major, minor = v.split("+")[0].split(".")[:2]
    return int(major), int(minor)


TORCH_VERSION = _version(torch.__version__)

DTENSOR_SUBCLASS_DISPATCH = TORCH_VERSION >= (2, 12) or TORCH_VERSION < (2, 10)
REDUCE_IN_ORIG_DTYPE = TORCH_VERSION >= (2, 15)
GRAD_IN_REDUCE_DTYPE = TORCH_VERSION >= (2, 15)

_ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
_REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


def new_dtensor(cls, local: torch.Tensor, spec, requires_grad: bool):
    """A `cls` DTensor wrapper over `local` with `spec` (its ``_local_tensor`` is set by the
    caller): torch 2.10's C++ constructor ``torch.Tensor._dtensor__new__``; 2.9's DTensor.__new__
    made the wrapper with ``torch.Tensor._make_dtensor`` from the spec's global shape and stride
    and set ``_spec`` itself."""
    if _DTENSOR_NEW is not None:
        return _DTENSOR_NEW(cls, local, spec, requires_grad=requires_grad)
    meta = spec.tensor_meta
    r = torch.Tensor._make_dtensor(cls, meta.shape, meta.stride, local, requires_grad)
    r._spec = spec
    return r


_DTENSOR_NEW = getattr(torch.Tensor, "_dtensor__new__", None)


def concatenate_meshes(meshes: list):
    """One mesh of the dims of `meshes`, in order: submeshes of one device mesh, not
    overlapping. ``DeviceMesh._concatenate`` from torch 2.10; 2.9's FSDP2 sliced the root mesh
    by the dims' names instead, which is what this does there. Raises RuntimeError for meshes
    that do not compose."""
    from torch.distributed.device_mesh import DeviceMesh

    concat = getattr(DeviceMesh, "_concatenate", None)
    if concat is not None:
        return concat(meshes)
    from torch.distributed.device_mesh import _mesh_resources

    roots = [_mesh_resources.get_root_mesh(m) for m in meshes]
    if any(r is None or r != roots[0] for r in roots):
        raise RuntimeError(f"the meshes are not submeshes of one device mesh (their root meshes: {roots})")
    names = tuple(n for m in meshes for n in (m.mesh_dim_names or ()))
    try:
        return roots[0][names]
    except (KeyError, ValueError, RuntimeError) as e:
        raise RuntimeError(f"the dims {names} do not make one submesh of {roots[0]}: {e}") from None


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """``dist.all_gather_single`` (torch >= 2.13) or ``dist.all_gather_into_tensor``."""
    return getattr(dist, _ALL_GATHER)(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    """``dist.reduce_scatter_single`` (torch >= 2.13) or ``dist.reduce_scatter_tensor``."""
    return getattr(dist, _REDUCE_SCATTER)(output, input, op=op, group=group, async_op=async_op)
