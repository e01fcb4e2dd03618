"""The flat layout of one unit: per-parameter shapes, padding and dtypes, fixed at
``fully_shard``, and the views of the unit's flat buffers built from them.

The sharded parameters are views into one flat buffer of ``sum(shard_units)`` elements (each
parameter's rank-local dim-0 shard, zero padded to its padded shard size), typed, or bytes
when the original dtypes differ. A parameter sharded on another dim (``shard_placement_fn``
returning ``Shard(d)``; d must then divide evenly, as torch FSDP2 requires) holds its
contiguous chunk of dim d there: all-gathered, rank ``r``'s chunk is ``chunk(ws, dim=d)[r]``,
which the codecs copy out with one strided copy (:meth:`Layout.by_rank`). The unsharded
parameters are views into one flat buffer of ``unsharded_numel`` elements of ``param_dtype``
(bytes when the unsharded dtypes differ, or when tensor-subclass parameters gather their own
tensors). Parameters are ordered by element size, largest first (:func:`itemsize_order`), so
every region of a byte buffer starts aligned for its dtype.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from fsdp_native import _extension, ops


# Alignment in bytes of every unsharded parameter in its unit's flat buffer (c10's CPU
# allocator aligns each tensor to 64 bytes; CUDA's caching allocator to more).
ALIGN = 64


def itemsize_order(params: list[nn.Parameter], param_dtypes: list | None = None) -> list[int] | None:
    """The parameter order of a unit with several dtypes (largest element first, stable: by
    the original dtype, then by the unsharded one); None when they share one dtype and keep
    their order."""
    unsharded = [d or p.dtype for p, d in zip(params, param_dtypes or [None] * len(params))]
    if len({p.dtype for p in params}) <= 1 and len(set(unsharded)) <= 1:
        return None
    return sorted(range(len(params)), key=lambda i: (-params[i].dtype.itemsize, -unsharded[i].itemsize))


class Layout:
    """Per-parameter facts of one unit (parameters in unit order).

    Attributes:
        world_size, rank: the shard group's size and this rank in it.
        shapes, numels, padded: global shapes, element counts, padded shard sizes.
        orig_dtypes, param_dtypes: sharded and unsharded (compute) dtypes.
        requires_grad: whether each parameter takes gradients.
        dims, strided: each parameter's shard dim, and the parameters whose chunks are not
            contiguous in the unsharded tensor (dim > 0 over several ranks).
        ext, has_ext: which parameters use torch's all-gather extension protocol.
        orig_dtype, shard_units: the sharded flat buffer's dtype (uint8 when mixed) and each
            parameter's length in it.
        gather_bytes, param_dtype: whether the plain all-gather and the unsharded buffer are
            bytes, else their one dtype.
        ag_padded, total_padded: each parameter's length in a rank's plain all-gather chunk,
            and the chunk's length (with ``ag_tail`` bytes of tail padding after the last
            parameter when casts into several dtypes need every chunk aligned).
        reduce_total: reduce-scatter elements per rank.
        unsharded_numel, unsharded_offsets, unsharded_slots: length of the unsharded flat
            buffer, where each parameter starts in it (ALIGN-byte aligned) and its span.
        needs_cast: whether the plain all-gather casts the shards.
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        world_size: int,
        rank: int,
        param_dtype: "torch.dtype | None | list",
        ext: list[bool] | None = None,
        dims: list[int] | None = None,
    ) -> None:
        ws = world_size
        self.world_size, self.rank = ws, rank
        self.ext = [_extension.has_extension(p) for p in params] if ext is None else list(ext)
        self.has_ext = any(self.ext)
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.dims = [0] * len(params) if dims is None else list(dims)
        self.strided = [i for i, d in enumerate(self.dims) if d and ws > 1]
        # A shard of dim d > 0 divides evenly (checked at fully_shard): no padding.
        self.padded = [n // ws if d else ops.padded_shard_numel(s, ws) for s, n, d in zip(self.shapes, self.numels, self.dims)]
        self.orig_dtypes = [p.dtype for p in params]
        requested = param_dtype if isinstance(param_dtype, list) else [param_dtype] * len(params)
        self.param_dtypes = [r or d for r, d in zip(requested, self.orig_dtypes)]
        self.requires_grad = [p.requires_grad for p in params]
        mixed = len(set(self.orig_dtypes)) > 1 or self.has_ext
        self.orig_dtype = torch.uint8 if mixed else (self.orig_dtypes[0] if params else torch.float32)
        self.shard_units = [0 if e else n * d.itemsize for n, d, e in zip(self.padded, self.orig_dtypes, self.ext)] if mixed else self.padded
        self.gather_bytes = len(set(self.param_dtypes)) > 1 or self.has_ext
        self.param_dtype = torch.uint8 if self.gather_bytes else (self.param_dtypes[0] if params else self.orig_dtype)
        self.ag_padded = [n * d.itemsize for n, d in zip(self.padded, self.param_dtypes)] if self.gather_bytes else self.padded
        self.total_padded = sum(self.ag_padded)
        self.reduce_total = sum(self.padded)
        # Each unsharded parameter starts at a multiple of ALIGN bytes of the flat buffer, as a
        # tensor of its own would (torch FSDP2 allocates each one): some CPU kernels sum in
        # an order that depends on the address (an fp32 Linear with one output row is one
        # on AMD EPYC), so unaligned views would not compute torch's numbers bit for bit.
        unit = 1 if self.gather_bytes else self.param_dtype.itemsize
        step = max(ALIGN // unit, 1)
        self.unsharded_offsets, offset = [], 0
        for numel, d, e in zip(self.numels, self.param_dtypes, self.ext):
            n = 0 if e else numel * d.itemsize if self.gather_bytes else numel
            if n:
                offset = -(-offset // step) * step
            self.unsharded_offsets.append(offset)
            offset += n
        self.unsharded_numel = offset
        # Each parameter's span in that buffer, alignment gap after it included (segment sizes
        # for a copy-in straight into it).
        self.unsharded_slots = [e - o for o, e in zip(self.unsharded_offsets, self.unsharded_offsets[1:] + [offset])]
        self.needs_cast = self.param_dtypes != self.orig_dtypes
        # A byte all-gather that casts (param_dtype_override_fn: some parameters keep their
        # dtype): runs of parameters with one unsharded dtype, each copied in by one cast,
        # as (first, end, dtype, byte offset in a rank's chunk, bytes).
        self.cast_runs: list[tuple[int, int, torch.dtype, int, int]] = []
        self.ag_tail = 0
        if self.gather_bytes and self.needs_cast and not self.has_ext:
            offset = 0
            for i, (d, nbytes) in enumerate(zip(self.param_dtypes, self.ag_padded)):
                if offset % d.itemsize:
                    raise NotImplementedError(
                        f"fsdp_native: unsharded dtypes {[str(x) for x in self.param_dtypes]} leave parameter {i} unaligned "
                        "in the all-gather buffer"
                    )
                if self.cast_runs and self.cast_runs[-1][2] == d:
                    first, _, _, start, run = self.cast_runs[-1]
                    self.cast_runs[-1] = (first, i + 1, d, start, run + nbytes)
                else:
                    self.cast_runs.append((i, i + 1, d, offset, nbytes))
                offset += nbytes
            # Every rank's chunk starts aligned for the widest dtype: tail padding.
            self.ag_tail = -self.total_padded % 8
            self.total_padded += self.ag_tail
        # The copy-out's segments of a rank's chunk (the tail as one more, written nowhere).
        self.ag_segments = self.ag_padded + [self.ag_tail] if self.ag_tail else self.ag_padded

    def local_shape(self, i: int) -> tuple[int, ...]:
        """This rank's shard shape of parameter `i` (dim 0 uneven, the last rank's may be
        short or empty; another dim divides evenly)."""
        shape, d = self.shapes[i], self.dims[i]
        rows = -(-shape[d] // self.world_size)
        if d == 0:
            rows = max(0, min(rows, shape[0] - self.rank * rows))
        return (*shape[:d], rows, *shape[d + 1 :])

    def local_chunk(self, i: int, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of parameter `i` taken from its unsharded tensor `full`."""
        shape = self.local_shape(i)
        if self.dims[i]:
            return full.chunk(self.world_size, dim=self.dims[i])[self.rank]
        start = self.rank * self.padded[i]
        return full.reshape(-1)[start : start + math.prod(shape)].view(shape)

    def by_rank(self, i: int, t: torch.Tensor) -> torch.Tensor:
        """Unsharded parameter `i` (`t`, contiguous, its shape) as a strided view of shape
        ``(world_size, *local shape)``: index r is rank r's shard."""
        d, ws = self.dims[i], self.world_size
        shape = self.shapes[i]
        return t.view(*shape[:d], ws, shape[d] // ws, *shape[d + 1 :]).movedim(d, 0)

    def shard_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """This rank's shard of every parameter, as views into a flat padded buffer (typed
        views into a byte buffer when the dtypes differ)."""
        views, offset = [], 0
        by_bytes = flat.dtype == torch.uint8 and self.orig_dtype == torch.uint8
        for i, (units, dtype, ext) in enumerate(zip(self.shard_units, self.orig_dtypes, self.ext)):
            # A subclass parameter keeps its own shard: no bytes of the buffer (the view, empty,
            # is replaced by that shard).
            shape = self.local_shape(i)
            n = 0 if ext else math.prod(shape)
            if ext:
                shape = (0, *self.shapes[i][1:])
            if by_bytes:
                views.append(flat[offset : offset + n * dtype.itemsize].view(dtype).view(shape))
            else:
                views.append(flat[offset : offset + n].view(shape))
            offset += units
        return views

    def unsharded_views(self, flat: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """(flat views the copy-out writes, bytes when the all-gather moves bytes; typed views
        of the parameters' shapes, None for a subclass parameter, whose unsharded tensor comes
        from its fsdp_post_all_gather)."""
        plain, typed = [], []
        for shape, numel, dtype, ext, offset in zip(self.shapes, self.numels, self.param_dtypes, self.ext, self.unsharded_offsets):
            n = 0 if ext else numel * dtype.itemsize if self.gather_bytes else numel
            plain.append(flat[offset : offset + n])
            typed.append(None if ext else (plain[-1].view(dtype) if self.gather_bytes else plain[-1]).view(shape))
        return plain, typed
