"""Gradient reduction: units' gradients are packed into buckets, one reduce-scatter each.

A bucket closes once it holds ``bucket_bytes`` of reduce-scatter input. The default is 0:
every unit is reduced on its own, as torch FSDP2 does. Sharing a reduce-scatter between
small units saves collectives, but it holds memory torch does not: the shared input of k
units is alive at once where torch holds one unit's input plus the k units' sharded
gradients (k / world_size of it), so at world size 2 and up a bucket of several units
peaks above torch (tests/test_memory.py). At most one bucket is in flight by default:
issuing the next completes the previous, and the unsharded gradients are dropped as soon as
they are copied into the reduce-scatter input. ``set_reduce_scatter_max_input_buffers(k)``
(torch 2.15) lets the unit issuing a bucket keep up to k in flight, completing the oldest
first: the backward then waits on an exposed reduce-scatter less, for k - 1 more
reduce-scatter inputs (and outputs) alive.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdp_native import _comm, _compat, _trace, ops
from fsdp_native._unit import Unit

DEFAULT_BUCKET_BYTES = 0
_AVG = dist.ReduceOp.AVG  # the reduce-scatter op is SUM or AVG (Unit._divide_factors)


def reduces_by_all_reduce(group: dist.ProcessGroup) -> bool:
    """gloo's reduce-scatter clones its whole input synchronously and then all-reduces it; an
    asynchronous in-place all-reduce of our own buffer moves the same bytes without the clone."""
    return dist.get_backend(group) == "gloo"


@dataclass
class Entry:
    """One unit's gradients in a bucket. `grads` (the unsharded gradients) is dropped as soon
    as they are copied into the reduce-scatter input, as torch FSDP2 frees them: holding them
    until the bucket completes kept one unit's unsharded gradients alive into the next unit's
    backward."""

    unit: Unit
    grads: list | None
    has_grad: list[bool]

    @property
    def total(self) -> int:
        """Reduce-scatter elements per rank: only the parameters with a gradient are packed,
        as torch FSDP2 does (a frozen parameter's zeros would be communicated for nothing, and
        a larger buffer is summed in another order by gloo's ring at world size > 2)."""
        return sum(p for p, h in zip(self.unit.layout.padded, self.has_grad) if h)


class Bucket:
    def __init__(self, key: tuple) -> None:
        self.key = key
        self.entries: list[Entry] = []
        self.nbytes = 0
        self.issued = False
        self.work = None
        self.rs_in: torch.Tensor | None = None
        self.out: torch.Tensor | None = None

    def _copy_in(self, grads: list, padded: list, ws: int, out: torch.Tensor) -> None:
        try:
            ops.reduce_scatter_copy_in(grads, padded, ws, out)
        except (NotImplementedError, RuntimeError):
            self._check_sparse(grads)
            raise

    def _check_sparse(self, grads: list) -> None:
        """A sparse gradient (``nn.Embedding(sparse=True)``) cannot be reduce-scattered: the
        error names its parameter (torch FSDP2 fails with ``Could not run 'fsdp::chunk_cat' with
        arguments from the 'SparseCPU' backend``). Every rank raises it: each has one."""
        found = iter(grads)
        for e in self.entries:
            for i, h in enumerate(e.has_grad):
                g = next(found) if h else None
                if g is not None and g.layout is not torch.strided:
                    mod, name = e.unit.owners[i][0]
                    raise ValueError(
                        f"fully_shard: parameter '{name}' of {type(mod).__name__} in unit '{e.unit.fqn or 'root'}' got "
                        f"a gradient of layout {g.layout}, expected torch.strided: gradients are reduce-scattered "
                        "dense. Build the module with sparse=False (nn.Embedding, nn.EmbeddingBag)."
                    )

    def issue(self) -> None:
        self.issued = True
        rec = _trace.active
        t0 = _trace.now_us() if rec is not None else 0.0
        first = self.entries[0].unit
        ws, dtype, device = first.world_size, first.reduce_dtype, first.device
        pre, _, rs_op, _ = first._divide_factors()
        padded, grads, offset = [], [], 0
        strided = []  # (offset in a rank's chunk, layout, parameter, gradient): dims other than 0
        for e in self.entries:
            layout = e.unit.layout
            for i, (n, g, h) in enumerate(zip(layout.padded, e.grads, e.has_grad)):
                if not h:
                    continue
                if i in layout.strided:
                    strided.append((offset, layout, i, g))
                    g = g[:0]  # its slots are zeroed, then written by _strided_copy_in
                padded.append(n)
                grads.append(g)
                offset += n
            e.grads.clear()  # the caller's list too: `grads` below is then their only owner
            e.grads = None
        total = sum(e.total for e in self.entries)
        group = first.rs_group or first.info.shard_group
        comm = first.rs_comm  # a custom reduce-scatter (then the bucket holds this unit alone)
        by_all_reduce = ws > 1 and comm is None and reduces_by_all_reduce(group)
        in_place = len(self.entries) == 1 and not by_all_reduce and comm is None and first.can_reduce_in_place(self.entries[0].has_grad)

        alloc = first.allocator(comm, group)  # torch.empty's (size, *, dtype, device)

        def new_out() -> torch.Tensor:  # the unit's fresh gradient buffer, or a plain one
            return first.reduce_in_place_target() if in_place else alloc((total,), dtype=dtype, device=device)

        if ws == 1:
            out = new_out()
            self._copy_in(grads, padded, 1, out)
            del grads
            if pre is not None:
                out.div_(pre)
            self.out = out
            return
        st = first.streams
        anchor = first.sharded_flat
        st.wait(anchor, st.reduce_scatter, st.compute)  # gradients were computed on compute
        with st.use(st.reduce_scatter):
            rs_in = alloc((ws * total,), dtype=dtype, device=device)
            self._copy_in(grads, padded, ws, rs_in)
            if strided:
                _strided_copy_in(rs_in.view(ws, total), strided)
            if pre is not None:
                rs_in.div_(pre)
        st.wait(rs_in, st.compute, st.reduce_scatter)  # the unsharded gradients may be freed now
        del grads, strided
        # The output after the unsharded gradients are gone, as torch FSDP2 orders them: the
        # step's peak is often here (the unit's unsharded gradients and its reduce-scatter input).
        with st.use(st.reduce_scatter):
            if by_all_reduce:
                self.out = rs_in.narrow(0, first.rank * total, total)  # valid once the all-reduce is done
            else:
                self.out = new_out()
        self.rs_in = rs_in
        if rec is not None:
            t1 = _trace.now_us()
            names = "+".join(e.unit.fqn or "root" for e in self.entries)
            rec.span("reduce_scatter_copy_in", "copy", names, t0, t1)
            t0 = t1
        with st.use(st.reduce_scatter):
            if comm is not None:
                self.work = comm(output_tensor=self.out, input_tensor=rs_in, group=group, op=rs_op, async_op=True)
            elif by_all_reduce and _comm.reduce_scatter_sum_p2p(rs_in, group, ws):
                self.work = _comm.sum_into_own_chunk(rs_in, group, first.rank, average=rs_op == _AVG)
            elif by_all_reduce:
                self.work = dist.all_reduce(rs_in, op=rs_op, group=group, async_op=True)
            else:
                self.work = _compat.reduce_scatter_single(self.out, rs_in, op=rs_op, group=group, async_op=True)
        if rec is not None:
            per_unit = {e.unit.fqn: e.total * ws * dtype.itemsize for e in self.entries}
            rec.collective("reduce_scatter", "reduce_scatter", names, self.work, t0, rs_in.numel() * rs_in.element_size(), per_unit=per_unit, via="all_reduce" if by_all_reduce else "reduce_scatter")

    def _wait(self, st) -> None:
        """Waits on the collective (traced as a stall); compute then follows it."""
        rec = _trace.active
        t0 = _trace.now_us() if rec is not None else 0.0
        with st.use(st.reduce_scatter):
            st.wait_work(self.work)
        if rec is not None:
            rec.waited(self.work)
            rec.span("wait_reduce_scatter", "stall", "+".join(e.unit.fqn or "root" for e in self.entries), t0, _trace.now_us())
        self.work = None
        st.wait(self.out, st.compute, st.reduce_scatter)

    def _clear(self) -> None:
        self.entries = []
        self.out = None
        self.rs_in = None

    def discard(self) -> None:
        """Waits on the collective and drops its result (reset_iter_state)."""
        if self.work is not None:
            self._wait(self.entries[0].unit.streams)  # the buffers are freed after the collective
        self._clear()

    def finish(self) -> None:
        st = self.entries[0].unit.streams
        if self.work is not None:
            self._wait(st)
        offset = 0
        for e in self.entries:
            e.unit.pending_rs = None
            n = e.total
            out = self.out if len(self.entries) == 1 else self.out.narrow(0, offset, n)
            e.unit.take_reduced(out, e.has_grad)
            offset += n
        st.wait(self.out, st.reduce_scatter, st.compute)  # release the buffers after their last use
        self._clear()


def _strided_copy_in(rows: torch.Tensor, strided: list) -> None:
    """Writes gradients of parameters sharded on a dim other than 0 into the reduce-scatter
    input `rows` (world size x a rank's chunk): rank r's slot gets chunk r of that dim, by one
    strided copy per gradient (cast to the reduce dtype)."""
    ws = rows.shape[0]
    for offset, layout, i, g in strided:
        dst = rows[:, offset : offset + layout.padded[i]].view(ws, *layout.local_shape(i))
        dst.copy_(layout.by_rank(i, g if g.is_contiguous() else g.contiguous()))


class Reducer:
    """Per root: the open bucket and the ones in flight, oldest first."""

    def __init__(self) -> None:
        self.bucket_bytes = DEFAULT_BUCKET_BYTES
        self.open: Bucket | None = None
        self.inflight: deque[Bucket] = deque()

    def add(self, unit: Unit, grads: list, has_grad: list[bool]) -> None:
        key = unit.reduce_key()
        if self.open is not None and self.open.key != key:
            self.flush()
        if self.open is None:
            self.open = Bucket(key)
        b = self.open
        b.entries.append(Entry(unit, grads, has_grad))
        unit.pending_rs = b
        b.nbytes += unit.layout.reduce_total * unit.world_size * unit.reduce_dtype.itemsize
        if b.nbytes >= self.bucket_bytes:
            self.flush()

    def flush(self) -> None:
        b, self.open = self.open, None
        if b is None:
            return
        cap = b.entries[0].unit.rs_max_inputs
        while len(self.inflight) >= cap:
            self.inflight.popleft().finish()
        b.issue()
        self.inflight.append(b)

    def finish(self, bucket: Bucket) -> None:
        """Completes `bucket`, and the buckets in flight before it (in order)."""
        if bucket is self.open:
            self.flush()
        if any(b is bucket for b in self.inflight):
            while self.inflight:
                b = self.inflight.popleft()
                b.finish()
                if b is bucket:
                    return
        elif bucket.issued:
            bucket.finish()

    def finish_all(self) -> None:
        self.flush()
        while self.inflight:
            self.inflight.popleft().finish()

    def discard(self) -> None:
        """reset_iter_state: the open bucket is dropped unissued (every rank failed at the same
        point, so none issued it); the ones in flight complete and their results are dropped."""
        self.open = None
        while self.inflight:
            self.inflight.popleft().discard()
