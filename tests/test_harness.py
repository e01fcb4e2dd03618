"""The test harness itself: after it re-creates the process groups (a failed configuration,
the stall and fuzz tests), DTensor ops must see the new meshes.

DTensor caches sharding propagation by mesh layout, not by process group, in a Python lru
cache and in the C++ dispatch fast path. Without clearing both, an op on a DTensor of a
mesh built after the re-init returns an output on the mesh of the destroyed groups, whose
group names by then belong to other live groups: this test, with the fast-path cache left
alone, gets the stale mesh and an all-gather over a 4-rank group on a 2-rank mesh dim
("narrow unexpectedly changed concrete size"). Issue 11's rare segfault in an all-gather
after a re-init was suspected; the cause found later is gloo's (scripts/gloo_race_repro.py).

Also: dist_utils.full, which gathers DTensors for the comparisons without DTensor's functional
all-gather (gloo's allgather_coalesced, the one that corrupts the heap), gives full_tensor()'s
bits. And the ranks, forked from a fork server that imported torch before the test ran, get the
test's environment, and their stdout and stderr reach the test's captured streams.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import dist_utils
from dist_utils import ctx, run_distributed

N = 1 << 12


def _stale_mesh_after_reinit() -> None:
    ws = dist.get_world_size()
    old = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("replicate", "shard"))
    y = distribute_tensor(torch.ones(4 * N), old, [Shard(0), Replicate()]) * 2
    assert y.device_mesh is old
    dist_utils._reinit_pg(ctx())
    # Take the group names the old mesh used with groups of every rank.
    extra = [dist.new_group(list(range(ws))) for _ in range(4)]
    new = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("replicate", "shard"))
    y = distribute_tensor(torch.ones(4 * N), new, [Shard(0), Replicate()]) * 2
    names = [new.get_group(i).group_name for i in range(2)]
    assert y.device_mesh is new, f"an op after the re-init returned the old mesh (new mesh's groups {names})"
    full = y.full_tensor()
    assert full.shape == (4 * N,) and torch.equal(full, torch.full((4 * N,), 2.0)), full.shape
    del extra


def test_dtensor_ops_see_new_meshes_after_reinit():
    run_distributed(_stale_mesh_after_reinit, 4)


def _segfault_in_native_thread() -> None:
    """Rank 0 faults in a thread without a Python stack, as the rare gloo crash did."""
    import ctypes
    import threading
    import time

    dist.barrier()
    if dist.get_rank() == 0:
        threading.Thread(target=ctypes.string_at, args=(0,), daemon=True).start()
        time.sleep(30)
    dist.barrier()


def test_native_crash_is_reported_with_cpp_stacks(capfd):
    """A segfault is reported as the rank's death, with every thread's C++ frames (c10's fatal
    signal handler) so a crash in gloo's threads says where it was."""
    import pytest

    with pytest.raises(pytest.fail.Exception) as info:
        run_distributed(_segfault_in_native_thread, 2, timeout=60)
    assert "rank 0 died with exit code -11" in str(info.value), str(info.value)
    err = capfd.readouterr().err
    assert "SIGSEGV(11), PID:" in err and "frame #0:" in err, err[-2000:]


def _full_matches_full_tensor() -> None:
    """dist_utils.full gathers DTensors without DTensor's functional all-gather (gloo's
    allgather_coalesced, issue 11): bit for bit what full_tensor() gives, for the placements
    FSDP and HSDP use, uneven and empty shards, and a dtype gloo has no type for (float8)."""
    ws = dist.get_world_size()
    meshes = [(init_device_mesh("cpu", (ws,)), [Shard(0)])]
    if ws == 4:
        meshes.append((init_device_mesh("cpu", (2, 2)), [Replicate(), Shard(0)]))
    checked = 0
    for mesh, placements in meshes:
        for shape in [(1,), (3,), (5, 7), (2 * ws, 3), (ws + 1, 2, 3), (0, 4), (3, 0)]:
            for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int64):
                g = torch.Generator().manual_seed(checked)
                x = (torch.randn(shape, generator=g) * 100).to(dtype)
                d = distribute_tensor(x, mesh, placements, src_data_rank=None)  # x is the same on every rank
                got = dist_utils.full(d)
                assert got.shape == x.shape and got.dtype == dtype, (shape, dtype, got.shape)
                assert torch.equal(got.view(torch.uint8), x.view(torch.uint8)), (placements, shape, dtype)
                if dtype != torch.float8_e4m3fn:  # gloo has no float8 type: full_tensor() raises
                    assert torch.equal(got.view(torch.uint8), d.full_tensor().view(torch.uint8)), (placements, shape, dtype)
                checked += 1
    # A DTensor with a partial placement is left to full_tensor().
    from torch.distributed.tensor import Partial

    mesh = meshes[0][0]
    p = torch.distributed.tensor.DTensor.from_local(torch.ones(3), mesh, [Partial()])
    assert torch.equal(dist_utils.full(p), torch.full((3,), float(ws)))


def test_full_matches_full_tensor_ws2():
    run_distributed(_full_matches_full_tensor, 2)


def test_full_matches_full_tensor_hsdp():
    run_distributed(_full_matches_full_tensor, 4)


@pytest.fixture(scope="module")
def fork_server_started():
    """Starts the fork server (where no earlier test did) outside the test's own capture, and
    with a variable set that the test no longer has."""
    os.environ["FSDP_TEST_REMOVED_BY_THE_TEST"] = "1"
    try:
        run_distributed(dist.barrier, 1)
    finally:
        del os.environ["FSDP_TEST_REMOVED_BY_THE_TEST"]


def _report_environment_and_print(name: str) -> None:
    """Each rank checks the environment it got and writes a line to stdout and to stderr."""
    import sys

    rank = dist.get_rank()
    assert os.environ.get(name) == "set-by-the-test", f"rank {rank}: {name}={os.environ.get(name)!r}"
    assert os.environ.get("FSDP_TEST_REMOVED_BY_THE_TEST") is None, f"rank {rank} has a variable the test removed"
    print(f"rank {rank} stdout line")
    sys.stderr.write(f"rank {rank} stderr line\n")


def test_ranks_get_the_tests_environment_and_their_output_is_relayed(fork_server_started, monkeypatch, capfd):
    """Ranks fork from a fork server started before this test: they must still see the
    environment as the test left it, and what they print must reach the test's streams."""
    monkeypatch.setenv("FSDP_TEST_SET_BY_THE_TEST", "set-by-the-test")
    run_distributed(_report_environment_and_print, 2, "FSDP_TEST_SET_BY_THE_TEST")
    out, err = capfd.readouterr()
    assert out.splitlines() == ["rank 0 stdout line", "rank 1 stdout line"], out
    assert "rank 0 stderr line\n" in err and "rank 1 stderr line\n" in err, err


def test_start_method_switch_is_checked(monkeypatch):
    monkeypatch.setenv("FSDP_TEST_START", "fork")
    with pytest.raises(ValueError) as e:
        run_distributed(dist.barrier, 1)
    assert str(e.value) == "FSDP_TEST_START must be 'forkserver' or 'spawn', got 'fork'"


def _modules_inherited(wanted: list[str], absent: list[str]) -> None:
    import sys

    rank = dist.get_rank()
    assert all(m in sys.modules for m in wanted), f"rank {rank}: {[m for m in wanted if m not in sys.modules]} not preloaded"
    assert not any(m in sys.modules for m in absent), f"rank {rank}: {[m for m in absent if m in sys.modules]} inherited"


def test_preload_restarts_the_fork_server_and_the_next_test_starts_from_torch_alone():
    """A test naming modules to preload (the Hugging Face tests) gets ranks that inherit them;
    the next test naming none gets ranks from a fork server without them (so no other test's
    ranks start with, say, transformers imported); naming the same modules again works too.
    (wave, a standard module nothing here imports, stands for them.)"""
    run_distributed(_modules_inherited, 2, ["torch"], ["wave"])
    run_distributed(_modules_inherited, 2, ["torch", "wave"], [], preload=("wave",))
    run_distributed(_modules_inherited, 1, ["torch", "wave"], [], preload=("wave",))
    run_distributed(_modules_inherited, 2, ["torch"], ["wave"])
