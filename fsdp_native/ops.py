"""Python wrappers of the native packing ops (``torch.ops.fsdp_native.*``).

A unit's parameters are sharded on dim 0 over ``world_size`` ranks. Parameter ``i`` holds
``numel_i`` elements; every rank's shard of it is padded to ``padded_numels[i]`` elements
(``ceil(dim0 / world_size) * row_numel``). A flat buffer of one rank is the concatenation of
its padded shards; an all-gather output (reduce-scatter input) is ``world_size`` such chunks.
Rank ``r`` holds the elements ``[r * padded_i, min((r + 1) * padded_i, numel_i))`` of
parameter ``i``. Casts between float32, bfloat16 and float16 are fused into the copies;
mixed dtypes within a unit go through byte views (``tensor.view(torch.uint8)``). Casts from
or to other floating dtypes (float64 parameters under a mixed precision policy, say), which
the native kernels leave out, run as torch copies with the same results (:func:`_composite`).
"""
from collections.abc import Sequence

import torch

__all__ = [
    "all_gather_copy_in",
    "all_gather_copy_out",
    "reduce_scatter_copy_in",
    "reduce_scatter_copy_out",
    "stream_wait",
    "padded_shard_numel",
]


def padded_shard_numel(shape: Sequence[int], world_size: int) -> int:
    """Elements of one rank's padded dim-0 shard of a tensor of ``shape``."""
    if len(shape) == 0:
        return 1
    rows = -(-shape[0] // world_size)
    row_numel = 1
    for s in shape[1:]:
        row_numel *= s
    return rows * row_numel


def all_gather_copy_in(shards: Sequence[torch.Tensor], padded_numels: Sequence[int], out: torch.Tensor) -> None:
    """Packs this rank's ``shards`` into ``out`` (this rank's slice of the all-gather buffer).

    ``shards[i]`` (contiguous, at most ``padded_numels[i]`` elements) is written, cast to
    ``out.dtype``, at offset ``sum(padded_numels[:i])``; the rest of its padded slot is zeroed.
    ``out`` is contiguous with ``sum(padded_numels)`` elements.
    """
    args = (list(shards), list(padded_numels), out)
    try:
        torch.ops.fsdp_native.all_gather_copy_in(*args)
    except RuntimeError as e:
        _composite(e, _all_gather_copy_in_torch, args, shards, (out,))


def all_gather_copy_out(
    all_gather_output: torch.Tensor, padded_numels: Sequence[int], world_size: int, outs: Sequence[torch.Tensor]
) -> None:
    """Unpacks an all-gather output (``world_size`` chunks of ``sum(padded_numels)``) into
    each parameter's unsharded tensor ``outs[i]`` (cast to its dtype), dropping padding."""
    args = (all_gather_output, list(padded_numels), world_size, list(outs))
    try:
        torch.ops.fsdp_native.all_gather_copy_out(*args)
    except RuntimeError as e:
        _composite(e, _all_gather_copy_out_torch, args, (all_gather_output,), outs)


def reduce_scatter_copy_in(
    grads: Sequence[torch.Tensor], padded_numels: Sequence[int], world_size: int, out: torch.Tensor
) -> None:
    """Packs unsharded gradients into the reduce-scatter input ``out`` (``world_size`` chunks,
    chunk ``r`` holding every gradient's rank-``r`` slice, zero padded), cast to ``out.dtype``."""
    args = (list(grads), list(padded_numels), world_size, out)
    try:
        torch.ops.fsdp_native.reduce_scatter_copy_in(*args)
    except RuntimeError as e:
        _composite(e, _reduce_scatter_copy_in_torch, args, grads, (out,))


def reduce_scatter_copy_out(
    shard: torch.Tensor,
    padded_numels: Sequence[int],
    grads: Sequence[torch.Tensor],
    *,
    divide_factor: float = 1.0,
    accumulate: bool = False,
) -> None:
    """Writes (or with ``accumulate`` adds) this rank's reduced flat ``shard``, divided by
    ``divide_factor``, into each sharded gradient ``grads[i]`` in its own dtype."""
    args = (shard, list(padded_numels), float(divide_factor), bool(accumulate), list(grads))
    try:
        torch.ops.fsdp_native.reduce_scatter_copy_out(*args)
    except RuntimeError as e:
        _composite(e, _reduce_scatter_copy_out_torch, args, (shard,), grads)


def stream_wait(anchor: torch.Tensor, waiter: "torch.Stream | None", signaler: "torch.Stream | None") -> None:
    """Makes stream ``waiter`` wait for the work queued so far on ``signaler``, through an
    event and with no host synchronisation (no ``recordStream``).

    Two uses: hand a buffer produced on a communication stream to the compute stream
    (``waiter=compute, signaler=comm``), and release a buffer allocated on the communication
    stream once the compute stream is done with it (``waiter=comm, signaler=compute``, then
    drop the last reference: the allocator reuses the memory only in the comm stream's
    order, which now follows the consumer). ``anchor`` picks the device. On CPU it is a no-op.
    """
    waiter_id = waiter.stream_id if waiter is not None else 0
    signaler_id = signaler.stream_id if signaler is not None else 0
    torch.ops.fsdp_native.stream_wait(anchor, waiter_id, signaler_id)


# --------------------------------------------------------------------------- other float dtypes
def _composite(error: RuntimeError, fn, args, sources, targets) -> None:
    """The native op raised `error`. When it refused a dtype pair of which both sides are
    floating-point, runs ``fn(*args)`` instead: the same op on torch casts of its arguments to
    dtypes the native kernels take, so that the native op still checks every argument before
    anything is written. Any other refusal is raised as it is."""
    if ": unsupported dtype pair for '" not in str(error) or not all(
        t.dtype.is_floating_point for t in (*sources, *targets)
    ):
        raise error
    fn(*args)


def _all_gather_copy_in_torch(shards, padded_numels, out) -> None:
    torch.ops.fsdp_native.all_gather_copy_in([s.to(out.dtype) for s in shards], padded_numels, out)


def _all_gather_copy_out_torch(all_gather_output, padded_numels, world_size, outs) -> None:
    dtype = all_gather_output.dtype
    staged = [o if o.dtype == dtype else torch.empty_like(o, dtype=dtype) for o in outs]
    torch.ops.fsdp_native.all_gather_copy_out(all_gather_output, padded_numels, world_size, staged)
    for o, t in zip(outs, staged):
        if t is not o:
            o.copy_(t)


def _reduce_scatter_copy_in_torch(grads, padded_numels, world_size, out) -> None:
    torch.ops.fsdp_native.reduce_scatter_copy_in([g.to(out.dtype) for g in grads], padded_numels, world_size, out)


def _reduce_scatter_copy_out_torch(shard, padded_numels, divide_factor, accumulate, grads) -> None:
    # The arithmetic runs in float32, as the native kernels', or in float64 where a side is.
    wide = torch.float64 in (shard.dtype, *(g.dtype for g in grads))
    opmath = torch.float64 if wide else torch.float32
    staged = [torch.empty_like(g, dtype=opmath) for g in grads]
    if wide:  # the native kernels divide in float32 only: check the factor as they do
        if not divide_factor > 0.0:
            raise RuntimeError(
                f"fsdp_native::reduce_scatter_copy_out: argument 'divide_factor' is {divide_factor:g}, expected a positive number"
            )
        torch.ops.fsdp_native.reduce_scatter_copy_out(shard.to(opmath), padded_numels, 1.0, False, staged)
        if divide_factor != 1.0:
            for t in staged:
                t.mul_(1.0 / divide_factor)
    else:
        torch.ops.fsdp_native.reduce_scatter_copy_out(shard.to(opmath), padded_numels, divide_factor, False, staged)
    for g, t in zip(grads, staged):
        g.copy_(g.to(opmath) + t if accumulate else t)


def _check_count(name: str, seq, padded_numels) -> None:
    torch._check(
        len(seq) == len(padded_numels),
        lambda: f"argument 'padded_numels' has {len(padded_numels)} entries, expected {len(seq)}",
    )


@torch.library.register_fake("fsdp_native::all_gather_copy_in")
def _(shards, padded_numels, out):
    _check_count("shards", shards, padded_numels)
    torch._check(out.numel() == sum(padded_numels), lambda: "argument 'out' has the wrong number of elements")


@torch.library.register_fake("fsdp_native::all_gather_copy_out")
def _(all_gather_output, padded_numels, world_size, outs):
    _check_count("outs", outs, padded_numels)
    torch._check(all_gather_output.numel() == world_size * sum(padded_numels))


@torch.library.register_fake("fsdp_native::reduce_scatter_copy_in")
def _(grads, padded_numels, world_size, out):
    _check_count("grads", grads, padded_numels)
    torch._check(out.numel() == world_size * sum(padded_numels))


@torch.library.register_fake("fsdp_native::reduce_scatter_copy_out")
def _(shard, padded_numels, divide_factor, accumulate, grads):
    _check_count("grads", grads, padded_numels)
    torch._check(shard.numel() == sum(padded_numels))


@torch.library.register_fake("fsdp_native::stream_wait")
def _(anchor, waiter_stream, signaler_stream):
    return None
