"""Large all-gathers and reduce-scatters on gloo as point-to-point exchanges.

gloo's ring all-gather and all-reduce (its reduce-scatter is an all-reduce) move a unit's
data in pipelined segments through the process group's worker threads. For one large
message per peer, torch.distributed's point-to-point ``isend`` / ``irecv`` on the same
process group costs about half the time and CPU (2 ranks, 9.4 MiB per rank: all-gather 6.5
vs 10.5 ms, reduce-scatter 7.5 vs 13.5 ms; ``benchmarks/bench_collectives.py``), while for
small messages it is slower. So on gloo, a collective whose per-peer message is at least
``P2P_MIN_BYTES`` is done as direct exchanges with every peer:

* all-gather: this rank's shard goes to every peer, every peer's shard lands in its slot;
* reduce-scatter (sum, 2 ranks only): this rank sends the peer's chunk of its input and adds
  the chunk it receives into its own. With two ranks a sum has one rounding whatever the
  order, so the result is bit for bit gloo's all-reduce; with more ranks the order of the
  additions would differ, so those keep the all-reduce.

Every rank issues fsdp_native's collectives in the same order, so sends and receives match
in order; they use a tag of their own, so they cannot match a user's point-to-point traffic
on the same group (tag 0 by default).
"""
from __future__ import annotations

import math
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from fsdp_native import _compat
from fsdp_native._env import non_negative_int

_TAG = 0x46534450  # "FSDP"


def group_allocate(group: dist.ProcessGroup, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A collective's buffer from the process group's own allocator where its backend has one
    (NCCL's, for zero-copy transfers), else ``torch.empty``, as torch FSDP2 allocates with
    ``set_allocate_memory_from_process_group_for_comm``."""
    backend = group._get_backend(device)
    if backend.supports_tensor_alloc(device):
        return backend.allocate_tensor(math.prod(size), dtype=dtype, device=device)
    return torch.empty(*size, dtype=dtype, device=device)

# Per-peer message size from which gloo collectives become point-to-point exchanges
# (FSDP_NATIVE_P2P_MIN_BYTES; 0 turns the point-to-point path off). 2 MiB: the overhead
# model's 1 MiB messages lose as exchanges (they cannot be polled), while the 2.4 MB fp8
# all-gathers of 4.7 MB bf16 units win (BENCHMARKS.md "Point-to-point threshold").
P2P_MIN_BYTES_DEFAULT = 2 << 20
P2P_MIN_BYTES = non_negative_int("FSDP_NATIVE_P2P_MIN_BYTES", P2P_MIN_BYTES_DEFAULT, "bytes")


def _p2p(group: dist.ProcessGroup, nbytes: int) -> bool:
    return 0 < P2P_MIN_BYTES <= nbytes and dist.get_backend(group) == "gloo"


class P2PWork:
    """The sends and receives of one exchange, waited as one; `finish` runs after them.

    gloo's point-to-point works report completion only once waited on, so there is nothing
    to poll: `pollable` tells ``Streams.wait_work`` to block at once."""

    __slots__ = ("works", "finish")
    pollable = False

    def __init__(self, works: list, finish=None) -> None:
        self.works = works
        self.finish = finish

    def wait(self, timeout: float | None = None) -> bool:
        """`timeout`: seconds for all the works together (``_stall``'s raise mode). An expired
        gloo point-to-point wait closes the connection to the peer: only for a wait that is
        given up on."""
        end = None if timeout is None else time.perf_counter() + timeout
        for w in self.works:
            if end is None:
                w.wait()
            else:
                # Whole milliseconds, rounded up: c10d truncates the timedelta to milliseconds,
                # and gloo's wait then ended up to 1 ms before `end` (the caller took its
                # "Timed out waiting 1999ms" for a failure before the threshold: test_stall).
                w.wait(timedelta(milliseconds=math.ceil(max(end - time.perf_counter(), 0.001) * 1000)))
        self.works = []
        if self.finish is not None:
            finish, self.finish = self.finish, None
            finish()
        return True


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, rank: int, size: int):
    """Gathers `size` equal shards into `out` (rank r's at slot r), asynchronously; `inp` may be
    this rank's slot of `out` already. Returns the work to wait on."""
    n = inp.numel()
    if not _p2p(group, n * inp.element_size()):
        return _compat.all_gather_single(out, inp, group=group, async_op=True)
    works = [
        dist.irecv(out.narrow(0, peer * n, n), group=group, group_src=peer, tag=_TAG)
        for peer in range(size)
        if peer != rank
    ]
    works += [dist.isend(inp, group=group, group_dst=peer, tag=_TAG) for peer in range(size) if peer != rank]
    mine = out.narrow(0, rank * n, n)
    if mine.data_ptr() != inp.data_ptr():
        mine.copy_(inp)
    return P2PWork(works)


def reduce_scatter_sum_p2p(inp: torch.Tensor, group: dist.ProcessGroup, size: int) -> bool:
    """Whether `sum_into_own_chunk` applies to this input and group."""
    return size == 2 and _p2p(group, inp.numel() // 2 * inp.element_size())


def sum_into_own_chunk(inp: torch.Tensor, group: dist.ProcessGroup, rank: int, average: bool = False):
    """2 ranks: after the returned work is waited on, this rank's chunk of `inp` (a flat
    buffer of 2 equal chunks) holds the sum (`average`: the mean) of both ranks' chunks, as an
    all-reduce of `inp` would leave it there. The peer's chunk of `inp` is left as it was."""
    n = inp.numel() // 2
    peer = 1 - rank
    received = torch.empty(n, dtype=inp.dtype, device=inp.device)
    works = [
        dist.irecv(received, group=group, group_src=peer, tag=_TAG),
        dist.isend(inp.narrow(0, peer * n, n), group=group, group_dst=peer, tag=_TAG),
    ]
    mine = inp.narrow(0, rank * n, n)

    def finish() -> None:
        mine.add_(received)
        if average:
            mine.div_(2)  # exact: a power of two

    return P2PWork(works, finish=finish)
