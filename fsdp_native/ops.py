"""Python wrappers of the native packing ops (``torch.ops.fsdp_native.*``).

A unit's parameters are sharded on dim 0 over ``world_size`` ranks. Parameter ``i`` holds
``numel_i`` elements; every rank's shard of it is padded to ``padded_numels[i]`` elements
(``ceil(dim0 / world_size) * row_numel``). A flat buffer of one rank is the concatenation of
its padded shards; an all-gather output (reduce-scatter input) is ``world_size`` such chunks.
Rank ``r`` holds the elements ``[r * padded_i, min((r + 1) * padded_i, numel_i))`` of
parameter ``i``. Casts between float32, bfloat16 and float16 are fused into the copies;
mixed dtypes within a unit go through byte views (``tensor.view(torch.uint8)``).
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
    torch.ops.fsdp_native.all_gather_copy_in(list(shards), list(padded_numels), out)


def all_gather_copy_out(
    all_gather_output: torch.Tensor, padded_numels: Sequence[int], world_size: int, outs: Sequence[torch.Tensor]
) -> None:
    """Unpacks an all-gather output (``world_size`` chunks of ``sum(padded_numels)``) into
    each parameter's unsharded tensor ``outs[i]`` (cast to its dtype), dropping padding."""
    torch.ops.fsdp_native.all_gather_copy_out(all_gather_output, list(padded_numels), world_size, list(outs))


def reduce_scatter_copy_in(
    grads: Sequence[torch.Tensor], padded_numels: Sequence[int], world_size: int, out: torch.Tensor
) -> None:
    """Packs unsharded gradients into the reduce-scatter input ``out`` (``world_size`` chunks,
    chunk ``r`` holding every gradient's rank-``r`` slice, zero padded), cast to ``out.dtype``."""
    torch.ops.fsdp_native.reduce_scatter_copy_in(list(grads), list(padded_numels), world_size, out)


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
    torch.ops.fsdp_native.reduce_scatter_copy_out(
        shard, list(padded_numels), float(divide_factor), bool(accumulate), list(grads)
    )


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
