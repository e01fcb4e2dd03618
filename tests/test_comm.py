"""Point-to-point all-gather / reduce-scatter on gloo (``fsdp_native._comm``).

* The exchanges equal torch.distributed's collectives bit for bit: all-gather against
  ``all_gather_single`` (world sizes 2 and 4, fp32 / bf16, with and without the input already
  in its slot), the 2-rank sum / mean against ``all_reduce`` (fp32 and bf16 random data).
* Collectives below the size threshold, and reduce-scatters over more than 2 ranks, stay
  collectives.
* The runtime with the point-to-point path forced on for every size (threshold 1 byte) trains
  to the same losses and parameters as torch FSDP2 over a grid: fp32 / bf16, reshard True /
  False / int (the post-forward group), prefetch, accumulation, CPU offload, HSDP 2x2, a 1-D
  mesh of 4.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from dist_utils import run_distributed, run_grid
from test_fully_shard_parity import check_parity


def _force_p2p(min_bytes: int = 1) -> None:
    from fsdp_native import _comm

    _comm.P2P_MIN_BYTES = min_bytes


def _rand(n: int, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 10).to(dtype)


def _exchange_body(dtype: str, n: int, in_place: bool):
    from fsdp_native import _comm, _compat

    _force_p2p()
    dt = getattr(torch, dtype)
    rank, ws = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    shard = _rand(n, dt, seed=100 + rank)
    expected = torch.empty(ws * n, dtype=dt)
    _compat.all_gather_single(expected, shard, group=group)
    out = torch.full((ws * n,), float("nan"), dtype=dt)
    inp = shard
    if in_place:
        inp = out.narrow(0, rank * n, n)
        inp.copy_(shard)
    work = _comm.all_gather(out, inp, group, rank, ws)
    assert isinstance(work, _comm.P2PWork), f"expected the point-to-point path, got {type(work).__name__}"
    work.wait()
    assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8)), f"all-gather differs from all_gather_single ({dtype}, n={n})"

    if ws == 2:
        for average in (False, True):
            buf = _rand(2 * n, dt, seed=200 + rank)
            ref = buf.clone()
            dist.all_reduce(ref, op=dist.ReduceOp.AVG if average else dist.ReduceOp.SUM, group=group)
            peer_chunk = buf.narrow(0, (1 - rank) * n, n).clone()
            assert _comm.reduce_scatter_sum_p2p(buf, group, ws)
            _comm.sum_into_own_chunk(buf, group, rank, average=average).wait()
            mine = buf.narrow(0, rank * n, n)
            want = ref.narrow(0, rank * n, n)
            assert torch.equal(mine.view(torch.uint8), want.view(torch.uint8)), (
                f"{'mean' if average else 'sum'} differs from all_reduce ({dtype}, n={n}): "
                f"max abs diff {(mine.float() - want.float()).abs().max().item():.3e}"
            )
            assert torch.equal(buf.narrow(0, (1 - rank) * n, n), peer_chunk), "the peer's chunk must be left as it was"
    else:
        assert not _comm.reduce_scatter_sum_p2p(torch.empty(ws * n, dtype=dt), group, ws), (
            "more than 2 ranks must keep the all-reduce (summation order)"
        )


def _threshold_body():
    from fsdp_native import _comm

    _force_p2p(4096)
    rank, ws = dist.get_rank(), dist.get_world_size()
    small = torch.zeros(1023)  # 4092 bytes per peer: below the threshold
    out = torch.empty(ws * 1023)
    work = _comm.all_gather(out, small, dist.group.WORLD, rank, ws)
    assert not isinstance(work, _comm.P2PWork), "a message below P2P_MIN_BYTES must use the collective"
    work.wait()
    assert not _comm.reduce_scatter_sum_p2p(torch.zeros(2 * 1023), dist.group.WORLD, 2)
    assert _comm.reduce_scatter_sum_p2p(torch.zeros(2 * 1024), dist.group.WORLD, 2)
    _force_p2p(0)
    assert not _comm.reduce_scatter_sum_p2p(torch.zeros(1 << 22), dist.group.WORLD, 2), "0 turns it off"


def _ws2_exchange():
    run_grid(
        [dict(dtype=d, n=n, in_place=ip) for d in ("float32", "bfloat16") for n in (1, 1000, 70001) for ip in (False, True)],
        _exchange_body,
        "exchange",
    )
    run_grid([{}], _threshold_body, "threshold")


def _ws4_exchange():
    run_grid([dict(dtype=d, n=4099, in_place=ip) for d in ("float32", "bfloat16") for ip in (False, True)], _exchange_body, "exchange")


def test_exchanges_match_collectives_ws2():
    run_distributed(_ws2_exchange, 2)


def test_exchanges_match_collectives_ws4():
    run_distributed(_ws4_exchange, 4)


def _parity_forced(**kw):
    from fsdp_native import _comm

    _force_p2p()
    made = []
    init = _comm.P2PWork.__init__

    def counting_init(self, works, finish=None):
        made.append(finish is not None)
        init(self, works, finish)

    _comm.P2PWork.__init__ = counting_init
    try:
        check_parity(**kw)
    finally:
        _comm.P2PWork.__init__ = init
        _force_p2p(_comm.P2P_MIN_BYTES_DEFAULT)
    reductions = sum(made)
    assert len(made) - reductions > 0, "no point-to-point all-gather ran"
    if dist.get_world_size() == 2 or kw.get("mesh") == "hsdp":
        assert reductions > 0, "no point-to-point reduce-scatter ran"


def _ws2_parity():
    configs = [
        dict(model="odd"),
        dict(model="even", mp="bf16", prefetch=True),
        dict(model="odd", reshard=False, accum=2),
        dict(model="odd", mp="bf16", offload=True),
        dict(model="even", reshard=1, optim="sgd"),
    ]
    run_grid(configs, _parity_forced, "p2p parity")


def _ws4_parity():
    configs = [
        dict(mesh="hsdp", model="odd"),
        dict(mesh="hsdp", model="even", mp="bf16"),
        dict(mesh="1d", model="odd", reshard=2),
    ]
    run_grid(configs, _parity_forced, "p2p parity")


def test_parity_with_p2p_forced_ws2():
    run_distributed(_ws2_parity, 2)


def test_parity_with_p2p_forced_ws4():
    run_distributed(_ws4_parity, 4, timeout=400)
