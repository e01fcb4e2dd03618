"""All-gather codecs: how a unit's shards become this rank's all-gather input, and how the
gathered buffer becomes the unsharded parameters. One is chosen per unit at ``fully_shard``
(:func:`choose`); the unit keeps the streams, the accounting and the collective call.

* :class:`PlainCodec`: the padded shards in the unsharded dtype (cast on copy-in when needed;
  the flat shard itself when not), the fast path;
* :class:`ExtensionCodec`: torch's tensor-subclass protocol (``fsdp_pre_all_gather`` /
  ``fsdp_post_all_gather``, see _extension.py), everything packed as bytes;
* :class:`Fp8Codec`, :class:`Nf4Codec`: fsdp_native's quantized all-gather (quant.py): codes
  and scales of the quantized parameters, then the other parameters' padded shards.
"""
from __future__ import annotations

import math

import torch

from fsdp_native import _extension, ops
from fsdp_native._api import QuantizedAllGather
from fsdp_native._layout import Layout


class Codec:
    """What a unit asks of its all-gather codec.

    Attributes:
        dtype: element dtype of the all-gather buffer.
        chunk: elements per rank of the all-gather; 0 when the unit gathers nothing.
        trace_args: extra arguments of the trace's all-gather span (the quantized format).
        in_place: the flat shard is the gathered data (one rank, no cast): no buffer, no
            collective.
        deferred: one rank with a cast: nothing is gathered, and the copy-out casts the shards
            straight into the unsharded parameters when the unit is waited on (as torch FSDP2
            at world size 1), so a prefetched unit holds no buffer before it is used.
        trace_copy_in: whether the unit records the copy-in as its own trace span.
        rebuilds_post_forward: whether ``post_forward_shard`` can rebuild an int
            reshard_after_forward's shard from the unsharded parameters.
    """

    dtype: torch.dtype
    chunk: int
    trace_args: dict = {}
    in_place = False
    deferred = False
    trace_copy_in = True
    rebuilds_post_forward = False

    def prepare(self, unit) -> int:
        """Called before each all-gather; returns its elements per rank."""
        return self.chunk

    def copy_in(self, unit, out: torch.Tensor, chunk: int) -> torch.Tensor:
        """Fills this rank's all-gather input (in `out`, or the flat shard) and returns it."""
        raise NotImplementedError

    def copy_out(self, unit, out: torch.Tensor) -> int:
        """Fills the unsharded parameters from the gathered `out`; returns the bytes it
        allocated beyond the unit's unsharded buffer."""
        raise NotImplementedError

    def free(self) -> int:
        """Frees what copy_out allocated; returns the bytes freed."""
        return 0

    def check_requires_grad(self, unit, i: int, requires_grad: bool) -> None:
        """Raises if parameter `i` cannot take the requires_grad it was given after
        fully_shard (the unit then makes its unsharded parameter follow it)."""

    def post_forward_shard(self, unit, first: int, count: int) -> torch.Tensor:
        """For an int reshard_after_forward, where ``rebuilds_post_forward``: ranks
        ``[first, first + count)``'s chunks of the all-gather, rebuilt from the unsharded
        parameters at the forward's end (torch FSDP2 also takes its post-forward shard from
        them, after the all-gather buffer is gone). Other codecs' units keep that slice of the
        gathered buffer from the copy-out instead."""
        raise NotImplementedError


def copy_out(
    unit, out: torch.Tensor, segments: list[int], targets: list[torch.Tensor], index: list | None = None, typed: list | None = None
) -> None:
    """``ops.all_gather_copy_out`` of `out` (world-size chunks of `segments`) into `targets`;
    ``index[k]`` is the parameter of segment k (None for other segments; no `index`: segment
    k is parameter k). A parameter sharded
    on a dim other than 0 (``layout.strided``) is not contiguous rank by rank in its unsharded
    tensor: it is skipped there and written by one strided copy from `out`, into ``typed[k]``
    (a subclass parameter's inner tensor output) or else its typed unsharded parameter."""
    layout = unit.layout
    ws = layout.world_size
    if not layout.strided:
        ops.all_gather_copy_out(out, segments, ws, targets)
        return
    strided = set(layout.strided)
    index = range(len(targets)) if index is None else index
    skip = out[:0]
    ops.all_gather_copy_out(out, segments, ws, [skip if j in strided else t for t, j in zip(targets, index)])
    rows, offset = out.view(ws, -1), 0
    for k, (seg, j) in enumerate(zip(segments, index)):
        if j in strided:
            dst = typed[k] if typed is not None and typed[k] is not None else unit._unsharded_typed[j]
            src = rows[:, offset : offset + seg]
            dtype = dst.dtype
            if src.dtype != dtype:  # bytes
                try:
                    src = src.view(dtype)
                except RuntimeError:  # chunks not aligned for `dtype` (a byte unit of odd size)
                    src = src.contiguous().view(dtype)
            # Without a version bump, as the native copy-out: autograd may have saved the
            # unsharded parameter in forward, and the backward's all-gather refills it.
            with torch.autograd._unsafe_preserve_version_counter(dst):
                layout.by_rank(j, dst).copy_(src.view(ws, *layout.local_shape(j)))
        offset += seg


class PlainCodec(Codec):
    rebuilds_post_forward = True

    def __init__(self, layout: Layout, staged: bool, post_forward: bool = False) -> None:
        self.layout = layout
        self.dtype = layout.param_dtype
        self.chunk = layout.total_padded
        self.staged = staged  # the shards live on CPU and are copied to the device first
        # The flat shard's padding is kept zero: with no cast it is the input as is.
        self.flat_is_input = not layout.needs_cast and not staged
        self.in_place = self.flat_is_input and layout.world_size == 1
        # At one rank the padded segments are the parameters' own sizes, so the casting
        # copy-in writes the unsharded buffer's layout (one typed buffer, not bytes).
        self.deferred = (
            layout.world_size == 1 and layout.needs_cast and not staged and not post_forward and not layout.gather_bytes
        )

    def copy_in(self, unit, out: torch.Tensor, chunk: int) -> torch.Tensor:
        if self.flat_is_input:
            return unit.sharded_flat
        layout = self.layout
        inp = out.narrow(0, layout.rank * chunk, chunk)
        if self.staged:
            staged = unit.sharded_flat.to(unit.device, non_blocking=True)
            if layout.needs_cast:
                self._cast_in(layout.shard_views(staged), inp)
            else:
                ops.all_gather_copy_in([staged], [chunk], inp)
        else:
            self._cast_in(unit.shard_views, inp)
        return inp

    def _cast_in(self, shards: list[torch.Tensor], inp: torch.Tensor) -> None:
        layout = self.layout
        if not layout.cast_runs:
            ops.all_gather_copy_in(shards, layout.padded, inp)
            return
        # Bytes with several unsharded dtypes: one casting copy-in per run of one dtype.
        for first, end, dtype, offset, nbytes in layout.cast_runs:
            ops.all_gather_copy_in(shards[first:end], layout.padded[first:end], inp.narrow(0, offset, nbytes).view(dtype))
        if layout.ag_tail:
            inp.narrow(0, layout.total_padded - layout.ag_tail, layout.ag_tail).zero_()

    def copy_out(self, unit, out: torch.Tensor | None) -> int:
        if out is None:  # deferred: cast the shards into the unsharded buffer
            ops.all_gather_copy_in(unit.shard_views, self.layout.unsharded_slots, unit.unsharded_flat)
            return 0
        layout = self.layout
        outs = unit._unsharded_plain + [out[:0]] if layout.ag_tail else unit._unsharded_plain
        copy_out(unit, out, layout.ag_segments, outs)
        return 0

    def post_forward_shard(self, unit, first: int, count: int) -> torch.Tensor:
        # The copy-out's inverse for `count` chunks: chunk r of the gathered buffer holds each
        # parameter's flat elements [r * segment, (r + 1) * segment), zero padded.
        layout = self.layout
        outs = unit._unsharded_plain + [unit._unsharded_plain[0][:0]] if layout.ag_tail else unit._unsharded_plain
        parts = []
        for i, (t, seg) in enumerate(zip(outs, layout.ag_segments)):
            if i in layout.strided:  # ranks [first, first + count)'s chunks of dim d, contiguous
                part = layout.by_rank(i, unit._unsharded_typed[i]).narrow(0, first, count).contiguous().reshape(-1)
                parts.append(part.view(torch.uint8) if layout.gather_bytes else part)
                continue
            flat = t.reshape(-1)
            lo = min(first * seg, flat.numel())
            parts.append(flat.narrow(0, lo, min((first + count) * seg, flat.numel()) - lo))
        shard = torch.empty(count * self.chunk, dtype=self.dtype, device=unit.device)
        ops.reduce_scatter_copy_in(parts, layout.ag_segments, count, shard)
        return shard


class ExtensionCodec(Codec):
    """One all-gather of bytes: every subclass parameter's inner tensors and every plain
    parameter's padded shard in its unsharded dtype. The sizes are known only once
    ``fsdp_pre_all_gather`` has run, at each all-gather."""

    dtype = torch.uint8
    trace_copy_in = False  # the copy-in is inside the all-gather span

    def __init__(self, layout: Layout, staged: bool = False) -> None:
        self.layout = layout
        self.staged = staged  # CPU offload: each subclass shard is moved to the device first
        self.chunk = layout.total_padded  # nonzero when there is anything to gather
        self.states = [_extension.ExtState() if e else None for e in layout.ext]
        self.segments: list[int] = []
        self._inputs: list[torch.Tensor] | None = None

    def prepare(self, unit) -> int:
        layout, info = self.layout, unit.info
        mesh = info.mesh if info.mesh.ndim == 1 else info.mesh[info.mesh.mesh_dim_names[-1]]
        inputs, segments = [], []
        casts: dict[torch.dtype, list[tuple[int, int]]] = {}  # param_dtype -> (input index, parameter)
        for i, local in enumerate(unit.shard_views):
            if self.staged:
                local = local.to(unit.device, non_blocking=True)
            if layout.ext[i]:
                mod = unit.owners[i][0][0]
                inners, meta = _extension.pre_all_gather(local, mesh, layout.shapes[i], mod, unit.mp)
                if i in layout.strided:
                    _check_strided_inners(layout, i, inners, unit.owners[i][0])
                state = self.states[i]
                state.sizes, state.meta = [t.shape for t in inners], meta
                state.ensure_outputs(inners, layout.world_size)  # made (or checked) now, allocated at the copy-out
                inputs += inners
                segments += [t.numel() * t.element_size() for t in inners]
            else:
                # The shard itself: the copy-in zero-fills its padded slot. One that needs a
                # cast to its param_dtype is cast below, with the others of that dtype.
                dtype = layout.param_dtypes[i]
                if local.dtype != dtype:
                    casts.setdefault(dtype, []).append((len(inputs), i))
                inputs.append(local.reshape(-1))
                segments.append(layout.padded[i] * dtype.itemsize)
        for dtype, items in casts.items():  # one casting copy per param_dtype, not one per parameter
            padded = [layout.padded[i] for _, i in items]
            buf = torch.empty(sum(padded), dtype=dtype, device=unit.device)
            ops.all_gather_copy_in([inputs[k] for k, _ in items], padded, buf)
            for (k, _), view in zip(items, buf.split(padded)):
                inputs[k] = view
        self.segments = segments
        self._inputs = inputs
        return sum(segments)

    def copy_in(self, unit, out: torch.Tensor, chunk: int) -> torch.Tensor:
        inputs, self._inputs = self._inputs, None
        inp = out.narrow(0, self.layout.rank * chunk, chunk)
        ops.all_gather_copy_in([t.reshape(-1).view(torch.uint8) for t in inputs], self.segments, inp)
        return inp

    def copy_out(self, unit, out: torch.Tensor) -> int:
        """Copies the gathered bytes into the plain parameters and into each subclass
        parameter's persistent outputs, then runs its fsdp_post_all_gather.

        A subclass parameter sharded on dim d > 0 has each inner tensor put together along d
        in its output (as torch FSDP2 does) by the strided copy of plain parameters on dim d,
        and the first unsharded tensor its fsdp_post_all_gather returns is viewed in the
        parameter's shape (torch FSDP2's ``as_strided``)."""
        layout = self.layout
        outs, index, typed, allocated = [], [], [], 0
        for i, view in enumerate(unit._unsharded_plain):
            if layout.ext[i]:
                state = self.states[i]
                allocated += state.alloc()
                outs += [o.view(torch.uint8) for o in state.outputs]
                index += [i] * len(state.outputs)
                typed += state.outputs
            else:
                outs.append(view)
                index.append(i)
                typed.append(None)
        copy_out(unit, out, self.segments, outs, index, typed)
        for i, local in enumerate(unit.shard_views):
            if layout.ext[i]:
                current = unit.unsharded_params[i]
                t = _extension.post_all_gather(local, self.states[i], layout.param_dtypes[i], current)
                if current is None:
                    if i in layout.strided and t.shape != layout.shapes[i]:
                        t = torch.as_strided(t, layout.shapes[i], torch.empty(layout.shapes[i], device="meta").stride(), 0)
                    unit.unsharded_params[i] = unit.new_unsharded_param(i, t, unit.sharded_params[i].requires_grad)
        return allocated

    def free(self) -> int:
        return sum(st.free() for st in self.states if st is not None)


def _check_strided_inners(layout: Layout, i: int, inners: list[torch.Tensor], owner) -> None:
    """A subclass parameter sharded on dim d > 0: each tensor its fsdp_pre_all_gather returns
    must hold as many elements as its shard, which torch FSDP2 also requires to put the
    gathered tensors together along d (it raises a view error)."""
    shape = layout.local_shape(i)
    n = math.prod(shape)
    if any(t.numel() != n for t in inners):
        mod, name = owner
        raise NotImplementedError(
            f"fsdp_native: parameter '{name}' of {type(mod).__name__} is sharded on dim {layout.dims[i]}, and its "
            f"fsdp_pre_all_gather returned all-gather inputs of shapes {[tuple(t.shape) for t in inners]}; a "
            f"tensor-subclass parameter sharded on a dim other than 0 must gather tensors of its shard's {n} "
            f"elements (shape {tuple(shape)})"
        )


_CHUNK_ALIGN = 16  # bytes: a quantized unit's chunk of each rank (QuantCodec)


class QuantCodec(Codec):
    """fsdp_native's quantized all-gather. One rank's chunk, in bytes:
    ``[quantized codes and scales (quant.unit_layout)][the other parameters' padded shards in
    the unsharded dtype]``; the copy-in is one quantize kernel for the unit. In a unit with
    several unsharded dtypes (no cast: each parameter's own, e.g. fp32 adapters beside bf16
    frozen weights) the other parameters travel as bytes. The chunk is padded to a multiple
    of 16 bytes, so that every rank's quantized region starts as aligned as the buffer (its
    fp32 scales need 4 bytes, the GPU kernels' widest accesses 16): other parameters of odd
    sizes would otherwise move the next rank's chunk off it."""

    dtype = torch.uint8

    def __init__(self, layout: Layout, policy: QuantizedAllGather, q: list[int], device: torch.device, staged: bool = False) -> None:
        from fsdp_native import quant

        self.layout, self.policy = layout, policy
        self.staged = staged  # CPU offload: the shards are copied to the device and quantized there
        self.trace_args = {"format": policy.format}
        self.q = q
        self.plain = [i for i in range(len(layout.shapes)) if i not in q]
        self.rows = [math.prod(layout.shapes[i][1:]) for i in q]
        self.q_padded = [layout.padded[i] for i in q]
        itemsize = layout.param_dtype.itemsize  # 1 when the unit gathers bytes
        self.q_bytes = quant.unit_layout(self.q_padded, self.rows, policy.format, block_size=policy.block_size).rank_nbytes
        plain_bytes = sum(layout.ag_padded[i] for i in self.plain) * itemsize
        self.tail = -(self.q_bytes + plain_bytes) % _CHUNK_ALIGN  # bytes; q_bytes is a multiple of 16
        self.chunk = self.q_bytes + plain_bytes + self.tail
        self.plain_padded = (
            [self.q_bytes // itemsize] + [layout.ag_padded[i] for i in self.plain] + ([self.tail // itemsize] if self.tail else [])
        )
        self.plain_index = [None] + self.plain + ([None] if self.tail else [])  # parameter of each segment
        self.empty = torch.empty(0, dtype=layout.param_dtype, device=device)
        self._zero_others: bool | None = None  # decided at the first all-gather (the group's backend)

    @staticmethod
    def quantizes(layout: Layout, i: int, policy: QuantizedAllGather) -> bool:
        """Whether parameter `i` is quantized; the others travel unquantized (also those sharded
        on a dim other than 0: rows and blocks follow dim 0)."""
        return len(layout.shapes[i]) >= 2 and layout.numels[i] >= policy.min_numel and not layout.dims[i]

    def copy_in(self, unit, out: torch.Tensor, chunk: int) -> torch.Tensor:
        from fsdp_native import quant

        inp = out.narrow(0, self.layout.rank * chunk, chunk)
        shards = unit.shard_views
        if self.staged:
            shards = self.layout.shard_views(unit.sharded_flat.to(unit.device, non_blocking=True))
        if self.plain or self.tail:  # zeroes the quantized region first (an empty source), then the shards
            if self.layout.gather_bytes:
                views = [self.empty] + [shards[i].reshape(-1).view(torch.uint8) for i in self.plain]
            else:
                views = [self.empty] + [shards[i] for i in self.plain]
            views += [self.empty] if self.tail else []
            ops.all_gather_copy_in(views, self.plain_padded, inp.view(self.layout.param_dtype))
        quant.quantize_copy_in(
            [shards[i] for i in self.q],
            self.q_padded,
            self.rows,
            inp.narrow(0, 0, self.q_bytes),
            format=self.policy.format,
            block_size=self.policy.block_size,
        )
        if self._zero_others is None:
            self._zero_others = _output_may_be_unwritten(unit.info.shard_group)
        if self._zero_others:
            # The other ranks' chunks read as zero codes and zero scales, i.e. zeros, if the
            # collective leaves them unwritten, instead of garbage scales taken as valid.
            rank, ws = self.layout.rank, self.layout.world_size
            out.narrow(0, 0, rank * chunk).zero_()
            out.narrow(0, (rank + 1) * chunk, (ws - rank - 1) * chunk).zero_()
        return inp

    def copy_out(self, unit, out: torch.Tensor) -> int:
        from fsdp_native import quant

        layout = self.layout
        ws = layout.world_size
        gathered = out.view(ws, self.chunk)[:, : self.q_bytes]
        outs = unit._unsharded_plain  # bytes when the unit gathers bytes
        quant.dequantize_copy_out(
            gathered,
            self.q_padded,
            self.rows,
            ws,
            [outs[i].view(layout.param_dtypes[i]) for i in self.q],
            format=self.policy.format,
            block_size=self.policy.block_size,
        )
        if self.plain:
            targets = [self.empty] + [outs[i] for i in self.plain] + ([self.empty] if self.tail else [])
            copy_out(unit, out.view(layout.param_dtype), self.plain_padded, targets, self.plain_index)
        return 0


# Backends whose all-gather always writes its whole output (or raises).
_WRITING_BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl", "cpu:gloo,cuda:nccl")


def _output_may_be_unwritten(group) -> bool:
    """Whether an all-gather on `group` may return without writing the other ranks' chunks:
    torch's fake process group (benchmarks: per-rank work real, collectives no-ops) and
    unknown backends."""
    import torch.distributed as dist

    if group is None or dist.get_world_size(group) == 1:
        return False
    try:
        backend = str(dist.get_backend(group)).lower()
    except Exception:  # noqa: BLE001 - an unregistered group: assume the worst
        return True
    return backend not in _WRITING_BACKENDS


class Fp8Codec(QuantCodec):
    """``fp8_rowwise`` and ``fp8_tensorwise``."""


class Nf4Codec(QuantCodec):
    """``nf4``: frozen parameters only (NF4 has no gradient path)."""

    @staticmethod
    def quantizes(layout: Layout, i: int, policy: QuantizedAllGather) -> bool:
        return QuantCodec.quantizes(layout, i, policy) and not layout.requires_grad[i]

    def check_requires_grad(self, unit, i: int, requires_grad: bool) -> None:
        if requires_grad and i in self.q:
            mod, name = unit.owners[i][0]
            raise ValueError(
                f"fsdp_native: parameter '{name}' of {type(mod).__name__} (unit '{unit.fqn or 'root'}') was frozen at fully_shard "
                "and is gathered in NF4 (all_gather=QuantizedAllGather('nf4')), which has no gradient path, but now "
                "requires grad; freeze it again, or call fully_shard after setting requires_grad"
            )


def choose(
    layout: Layout,
    all_gather: QuantizedAllGather | None,
    *,
    post_forward: bool,
    staged: bool,
    device: torch.device,
    names: list[str] | None = None,
) -> Codec:
    """The unit's codec: the extension protocol when it has subclass parameters, a quantized
    codec when `all_gather` asks for one and some parameter qualifies, else the plain one.
    Raises for what a codec does not support."""
    if all_gather is not None:
        codec = _quant_codec(layout, all_gather, device, names, staged)
        if codec is not None:
            return codec
    if layout.has_ext:
        return ExtensionCodec(layout, staged)
    return PlainCodec(layout, staged, post_forward)


def _quant_codec(
    layout: Layout, policy: QuantizedAllGather, device: torch.device, names: list[str] | None = None, staged: bool = False
) -> QuantCodec | None:
    from fsdp_native import quant

    where = f"fully_shard: argument 'all_gather' ({policy.format})"
    if layout.has_ext:
        raise NotImplementedError(f"{where} cannot be combined with tensor-subclass parameters (torch's all-gather extensions)")
    if layout.gather_bytes and layout.needs_cast:
        raise NotImplementedError(
            f"{where} with several unsharded dtypes in a unit needs them to be the parameters' own, got casts from "
            f"{sorted({str(d) for d in layout.orig_dtypes})} to {sorted({str(d) for d in layout.param_dtypes})} "
            "(mp_policy.param_dtype_override_fn); set mp_policy.param_dtype for all, or none"
        )
    cls = Nf4Codec if policy.format == quant.NF4 else Fp8Codec
    q = [i for i in range(len(layout.shapes)) if cls.quantizes(layout, i, policy)]
    for i in q:
        if layout.orig_dtypes[i] not in quant._FLOATS or layout.param_dtypes[i] not in quant._FLOATS:
            what = names[i] if names is not None else f"parameter {i}"
            raise ValueError(
                f"{where} quantizes float32, bfloat16 and float16 parameters; {what} is {layout.orig_dtypes[i]} "
                f"(unsharded {layout.param_dtypes[i]})"
            )
    return cls(layout, policy, q, device, staged) if q else None


def check_extension_params(params, owners, ext, dims, world_size: int, post_forward) -> None:
    """What fsdp_native supports of torch's all-gather extension protocol, checked at
    fully_shard: the shard dim divisible by the shard world size (each rank's inner tensors
    must have equal sizes; a dim other than 0 was checked with the placement), no int
    reshard_after_forward (torch FSDP2 raises NotImplementedError for it in the backward's
    all-gather)."""
    for p, owner, e, d in zip(params, owners, ext, dims):
        if not e:
            continue
        mod, name = owner[0]
        where = f"parameter '{name}' of {type(mod).__name__} ({type(p).__name__})"
        if d == 0 and (p.dim() == 0 or p.shape[0] % world_size):
            raise ValueError(
                f"fully_shard: {where} has shape {tuple(p.shape)}; a tensor-subclass parameter with "
                f"fsdp_pre_all_gather needs dim 0 divisible by the shard world size {world_size}"
            )
        if post_forward is not None:
            raise NotImplementedError(
                f"fully_shard: {where} uses the all-gather extension protocol, which fsdp_native does not support with "
                "an int reshard_after_forward"
            )
