"""torch FSDP2's all-gather extension protocol for tensor-subclass parameters.

A parameter whose rank-local shard defines ``fsdp_pre_all_gather`` and
``fsdp_post_all_gather`` (torchao's ``NF4Tensor``, its Float8 training weights) chooses what
is all-gathered:

* ``fsdp_pre_all_gather(mesh)`` (the older form) or
  ``fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)`` returns
  ``(inner tensors, metadata)``: the tensors to gather, each the same size on every rank;
* ``fsdp_post_all_gather(outputs, metadata, param_dtype, *, out=None)`` gets each inner
  tensor gathered over the ranks (``world_size`` times its dim 0) and returns the unsharded
  tensor plus the tensors whose storage may be freed on reshard; called again with ``out=``
  that tensor, it must find its data in the same outputs, which are therefore kept and
  refilled in place (their storage freed on reshard, re-allocated on unshard).

In a unit with such parameters every all-gather input (the inner tensors, and the padded
shards of the unit's plain parameters in their unsharded dtype) is packed as bytes into one
buffer, so the whole unit is still one collective.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
import torch.nn as nn


def has_extension(t: torch.Tensor) -> bool:
    pre, post = hasattr(t, "fsdp_pre_all_gather"), hasattr(t, "fsdp_post_all_gather")
    if pre != post:
        raise ValueError(
            f"fully_shard: a parameter of type {type(t).__name__} defines only "
            f"{'fsdp_pre_all_gather' if pre else 'fsdp_post_all_gather'}, expected both methods of torch's "
            "all-gather extension protocol or neither"
        )
    return pre


def own_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` whose storages hold ``t``'s elements only. A chunk of a subclass tensor
    is usually a view of each of its inner tensors, so it keeps the whole unsharded tensor
    alive. Subclasses are rebuilt from copies of their inner tensors (``__tensor_flatten__``),
    not with ``clone()``, which some define otherwise (torchao's NF4 re-quantizes with its
    default block sizes)."""
    if type(t) is torch.Tensor or not hasattr(t, "__tensor_flatten__"):
        return t.clone()
    names, ctx = t.__tensor_flatten__()
    inner = {n: own_copy(getattr(t, n)) for n in names}
    return type(t).__tensor_unflatten__(inner, ctx, t.size(), t.stride())


def _n_args(fn) -> int:
    return len(inspect.signature(fn).parameters)


def pre_all_gather(local: torch.Tensor, mesh, outer_size, module: nn.Module, mp_policy) -> tuple[list[torch.Tensor], object]:
    """Calls either form of ``fsdp_pre_all_gather``; returns the inner tensors (contiguous)
    and the metadata."""
    fn = local.fsdp_pre_all_gather
    n = _n_args(fn)
    if n == 1:
        inners, meta = fn(mesh)
    elif n == 5:
        stride = torch.empty(outer_size, device="meta").stride()
        inners, meta = fn(mesh, outer_size, stride, module, mp_policy)
    else:
        raise TypeError(
            f"fsdp_native: {type(local).__name__}.fsdp_pre_all_gather takes {n} arguments, expected 1 (mesh) or 5 "
            "(mesh, outer_size, outer_stride, module, mp_policy)"
        )
    inners = list(inners)
    for t in inners:
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"fsdp_native: {type(local).__name__}.fsdp_pre_all_gather returned a {type(t).__name__} among its "
                "all-gather inputs, expected tensors"
            )
    return [t.contiguous() for t in inners], meta


@dataclass
class ExtState:
    """Per extension parameter: the persistent all-gather outputs and what the last
    pre-all-gather returned."""

    outputs: list[torch.Tensor] = field(default_factory=list)  # 1-D, world_size * inner numel
    sizes: list[torch.Size] = field(default_factory=list)
    meta: object = None

    def ensure_outputs(self, inners: list[torch.Tensor], world_size: int) -> None:
        """Makes the outputs for these inner tensors (storage not allocated), or keeps the
        existing ones, which the unsharded tensor of an earlier post-all-gather views."""
        specs = [(t.numel() * world_size, t.dtype, t.device) for t in inners]
        if [(o.numel(), o.dtype, o.device) for o in self.outputs] != specs:
            self.outputs = [torch.empty(n, dtype=d, device=dev) for n, d, dev in specs]
            for o in self.outputs:
                o.untyped_storage().resize_(0)

    def alloc(self) -> int:
        """Allocates the outputs' storage; returns the bytes allocated."""
        new = 0
        for o in self.outputs:
            nbytes = o.numel() * o.element_size()
            if o.untyped_storage().nbytes() != nbytes:
                o.untyped_storage().resize_(nbytes)
                new += nbytes
        return new

    def unflattened(self) -> tuple[torch.Tensor, ...]:
        return tuple(o.view(-1, *s[1:]) for o, s in zip(self.outputs, self.sizes))

    def nbytes(self) -> int:
        return sum(o.untyped_storage().nbytes() for o in self.outputs)

    def free(self) -> int:
        freed = self.nbytes()
        for o in self.outputs:
            o.untyped_storage().resize_(0)
        return freed


def post_all_gather(local: torch.Tensor, state: ExtState, param_dtype: torch.dtype, current: nn.Parameter | None):
    """Runs ``fsdp_post_all_gather``. The first time (`current` None) it returns the unsharded
    tensor, for the caller to make the parameter of; afterwards it refills `current` in place
    (``out=current``, as torch FSDP2 passes it: with tensor parallelism a DTensor, whose local
    tensor torchao's Float8 weights update) and returns it."""
    outputs = state.unflattened()
    if current is not None:
        local.fsdp_post_all_gather(outputs, state.meta, param_dtype, out=current)
        return current
    res = local.fsdp_post_all_gather(outputs, state.meta, param_dtype)
    if not (isinstance(res, tuple) and len(res) == 2 and isinstance(res[0], torch.Tensor)):
        raise TypeError(
            f"fsdp_native: {type(local).__name__}.fsdp_post_all_gather returned {type(res).__name__}, expected "
            "(unsharded tensor, tensors to free)"
        )
    return res[0]
