"""The benchmarks' code paths, on CPU and quickly (no timing is asserted):

* benchmarks/bench_gpu.py --smoke: both implementations train tiny versions of its models on
  the fake process group (world size 8), and the packing ops run against their floor;
* bench_gpu's CUDA-only branches (memory statistics, CUDA-event timing, the report) with the
  torch.cuda calls they make replaced by stand-ins, so a mistake there shows before a GPU run;
* benchmarks/harness.py's launcher: results of rank 0 and of every rank, and a failing rank;
* the GPU tools (profile_quant_gpu.py, tune_quant_gpu.py) with Triton interpreted.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import triton_interpreter

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def test_bench_gpu_smoke(tmp_path):
    out = tmp_path / "smoke.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/bench_gpu.py"), "--smoke", "--json", str(out)],
        env=ENV, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [r["config"] for r in res["train"]] == [
        "overhead-fp32", "overhead-bf16", "llama8b-bf16", "llama8b-float8", "llama8b-nf4-qlora", "llama8b-own-fp8"]
    for r in res["train"]:
        assert not r["errors"], r["errors"]
        assert r["timing"]["ratio"] > 0
        want = {"torch", "fsdp_native"} if r["config"] != "llama8b-own-fp8" else {"fsdp_native", "fsdp_native:fp8_rowwise"}
        assert set(r["memory"]) == want == set(r["timing"]["median_ms"])
    assert not res["ops"]["errors"], res["ops"]["errors"]
    # 7 packing ops, 2 of them again as torch FSDP2 makes them, and 8 quantized all-gather
    # kernels (3 formats) per unit, 2 units
    assert len(res["ops"]["rows"]) == 34
    assert sum("(torch FSDP2's" in row["op"] for row in res["ops"]["rows"]) == 4
    assert all(row["host"]["of_floor"] > 0 for row in res["ops"]["rows"])
    assert "| overhead-fp32 |" in proc.stdout


_FAKE_CUDA = r'''
import sys, time
sys.argv.append("--smoke")  # bench_gpu's CPU settings at import
import torch
from benchmarks import bench_gpu as B, harness as H

counter = [0]
def allocated(*a):
    counter[0] += 4096
    return counter[0]

class Event:
    def __init__(self, enable_timing=False):
        self.t = None
    def record(self, stream=None):
        self.t = time.perf_counter()
    def synchronize(self):
        pass
    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3

for name, fn in {"synchronize": lambda *a, **k: None, "empty_cache": lambda: None,
                 "reset_peak_memory_stats": lambda *a: None, "memory_allocated": allocated,
                 "max_memory_allocated": allocated, "_sleep": lambda n: None, "Event": Event,
                 "memory_stats": lambda *a: {"requested_bytes.all.current": allocated(), "requested_bytes.all.peak": allocated()}}.items():
    setattr(torch.cuda, name, fn)

H.init_fake_process_group(B.WORLD_SIZE)
env = B.Env(torch.device("cpu"), smoke=True)
env.cuda = True  # the CUDA branches, with the stand-ins above
mesh = B.make_mesh(env)
tc = B.CONFIGS["overhead-bf16"]
mem = {impl: B.memory_run(impl, tc, env, mesh) for impl in tc.impls}
for m in mem.values():
    assert len(m["block_backward_start"]) == B.OVERHEAD_SMOKE.n_blocks, m
    assert all(isinstance(v, int) for v in m["block_backward_start"]), m
    for key in ("init_peak", "after_init", "step_peak", "between_steps", "after_delete", "step_peak_requested", "between_steps_requested"):
        assert isinstance(m[key], int), (key, m)
case = B.op_cases("work", B._block_shapes(B.OVERHEAD_SMOKE), env.device)[0]
row = B.time_op_case(case, env, iters=2, reps=2)
assert set(row) >= {"device", "host"} and row["device"]["of_floor"] > 0, row
qcase = B.quant_op_cases("work", B._block_shapes(B.OVERHEAD_SMOKE), env.device)[-1]
assert qcase.name == "dequantize nf4", qcase.name
qrow = B.time_op_case(qcase, env, iters=2, reps=2)
assert qrow["device"]["of_floor"] > 0, qrow
result = {"machine": H.machine_info(), "train": [{"config": tc.name, "errors": {}, "memory": mem,
          "timing": {"median_ms": {"torch": 1.0, "fsdp_native": 0.5}, "ratio": 0.5}}],
          "ops": {"rows": [row], "errors": {}}}
text = B.format_report(result)
assert "| overhead-bf16 | torch | 1.00 | fsdp_native | 0.50 | **0.50** |" in text, text
print("fake cuda ok")
'''


def test_bench_gpu_cuda_branches_with_stand_ins():
    proc = subprocess.run([sys.executable, "-c", _FAKE_CUDA], env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "fake cuda ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


_HARNESS = r'''
import os, sys
import torch.distributed as dist
from benchmarks import harness as H

def body(rank, world_size, port, fail):
    H.init_pg(rank, world_size, port)
    if fail and rank == 1:
        raise ValueError("rank 1 fails on purpose")
    out = H.max_over_ranks([float(rank)])
    dist.destroy_process_group()
    return (rank, out)

def exits_badly(rank, world_size, port):
    import atexit, time
    if rank == 1:
        atexit.register(os._exit, 3)  # fails on its way out, after its work
    else:
        time.sleep(2)  # rank 1 is gone before rank 0's result comes, as on a loaded machine
    return rank

if __name__ == "__main__":
    assert H.run_ranks(body, False, world_size=2, all_ranks=True) == [(0, [1.0]), (1, [1.0])]
    try:
        H.run_ranks(body, True, world_size=2, timeout_s=120)
    except RuntimeError as e:
        assert "a rank failed" in str(e), e
    else:
        raise AssertionError("a failing rank did not raise")
    assert H.run_ranks(exits_badly, world_size=2) == 0
    print("harness ok")
'''


def test_harness_run_ranks(tmp_path):
    script = tmp_path / "harness_check.py"
    script.write_text(_HARNESS)
    proc = subprocess.run([sys.executable, str(script)], env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "harness ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    # a rank that fails at exit, after the results are in, is reported, not passed over
    assert "exits_badly: rank 1 exited with code 3 after the results were in" in proc.stderr, proc.stderr[-3000:]
    assert "rank 0 exited" not in proc.stderr, proc.stderr[-3000:]


def test_harness_load_impl_names():
    """Implementation names of the benchmarks: a quantized all-gather after ':', compiled
    blocks after '+compile' (shard_model compiles each block before its fully_shard)."""
    sys.path.insert(0, str(ROOT))
    import torch.nn as nn

    from benchmarks.harness import load_impl
    from benchmarks.models import shard_model

    assert not load_impl("torch").compile_blocks
    im = load_impl("fsdp_native:fp8_rowwise+compile")
    assert im.compile_blocks and im.fully_shard.keywords["all_gather"].format == "fp8_rowwise"
    with pytest.raises(ValueError, match=r"implementation 'torch\+fast': unknown suffix '\+fast', expected '\+compile'"):
        load_impl("torch+fast")
    # '@dim1': shard_placement_fn puts matrices on dim 1 (where it divides the world size)
    im = load_impl("fsdp_native:nf4@dim1+compile")
    assert im.compile_blocks and im.fully_shard.keywords["all_gather"].format == "nf4"
    fn = im.fully_shard.keywords["shard_placement_fn"]
    assert fn.args == (1,) and fn.func.__name__ == "_shard_on"
    with pytest.raises(ValueError, match=r"implementation 'torch@rows': unknown suffix '@rows', expected '@dim<d>', e.g. '@dim1'"):
        load_impl("torch@rows")

    calls = []
    model = nn.Module()
    model.blocks = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    shard_model(model, lambda m, **kw: calls.append((m, m._compiled_call_impl is not None)), compile_blocks=True)
    assert calls == [(model.blocks[0], True), (model.blocks[1], True), (model, False)]


def test_gpu_memory_snapshot_groups_by_our_frames():
    """benchmarks/gpu_memory_snapshot.py's grouping of a CUDA memory snapshot (its GPU part
    needs a GPU): live blocks only, each under its innermost frame in fsdp_native / FSDP2 /
    torchao / optimizers / benchmarks."""
    sys.path.insert(0, str(ROOT))
    from benchmarks import gpu_memory_snapshot as G

    ours = {"filename": "/r/fsdp_native/_unit.py", "line": 199, "name": "_new_flat"}
    snap = {"segments": [{"blocks": [
        {"state": "active_allocated", "size": 1 << 20, "frames": [{"filename": "/t/torch/nn/functional.py", "line": 1, "name": "f"}, ours]},
        {"state": "active_allocated", "size": 512, "frames": [ours]},
        {"state": "inactive", "size": 1 << 30, "frames": [ours]},
        {"state": "active_allocated", "size": 7, "frames": []},
    ]}]}  # fmt: skip
    assert G.groups(snap) == {"/r/fsdp_native/_unit.py:199 _new_flat": (1 << 20) + 512, "(other)": 7}


def test_gpu_memory_snapshot_peak_replays_the_trace():
    """gpu_memory_snapshot.py --at peak: the live blocks at the highest point of the trace
    (allocs less free_requested; a free of a block allocated before the recording is ignored),
    grouped by frame."""
    sys.path.insert(0, str(ROOT))
    from benchmarks import gpu_memory_snapshot as G

    a = [{"filename": "/r/fsdp_native/_unit.py", "line": 1, "name": "a"}]
    b = [{"filename": "/r/fsdp_native/_reduce.py", "line": 2, "name": "b"}]
    trace = [
        {"action": "free_requested", "addr": 99, "size": 10**6},  # before the recording
        {"action": "alloc", "addr": 1, "size": 100, "frames": a},
        {"action": "alloc", "addr": 2, "size": 50, "frames": b},
        {"action": "free_requested", "addr": 1, "size": 100},
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 3, "size": 120, "frames": a},  # 170
        {"action": "alloc", "addr": 1, "size": 10, "frames": b},  # address reused; 180: the peak
        {"action": "free_requested", "addr": 3, "size": 120},
        {"action": "alloc", "addr": 4, "size": 100, "frames": []},  # 160
    ]
    top, at, g = G.peak_groups({"device_traces": [[], trace]}, device=1)
    assert (top, at) == (180, 6)
    assert g == {"/r/fsdp_native/_unit.py:1 a": 120, "/r/fsdp_native/_reduce.py:2 b": 60}
    assert G.peak_groups({"device_traces": [[]]}) == (0, 0, {})


def test_gpu_memory_snapshot_cpu_replay():
    """gpu_memory_snapshot.py --cpu: the highest bytes of the forward and of each block's
    backward, for both implementations, from the CPU allocator's events (a tiny llama)."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_memory_snapshot.py"), "llama8b-bf16", "--cpu",
                        "--dims", "64", "160", "2", "2", "1", "128", "32"],
                       env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    import re

    rows = {m[1]: (float(m[2]), float(m[3])) for m in re.finditer(r"^   (\S.*?)\s+([\d.]+) /\s+([\d.]+)\s+\(", r.stdout, re.M)}
    assert list(rows) == ["forward and loss", "backward of blocks.1", "backward of blocks.0"], r.stdout
    assert all(a > 0 and b > 0 for a, b in rows.values()), r.stdout
    assert "== held at the top of the" in r.stdout and "fsdp_native/" in r.stdout, r.stdout


def test_profile_quant_gpu_lists_each_op_and_its_kernels():
    """benchmarks/profile_quant_gpu.py (what ncu profiles on a GPU) on CPU: every quant op of
    bench_gpu.py once, with the Triton kernels it launched (interpreted), in launch order."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run(triton_interpreter.command(str(ROOT / "benchmarks" / "profile_quant_gpu.py"), "--smoke", "--triton"),
                       env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ": " in ln]
    assert lines == [
        "quantize fp8_tensorwise: _amax_kernel, _fp8_quantize_kernel",
        "quantize fp8_tensorwise, amax given: _fp8_quantize_kernel",
        "quantize_amax: _amax_kernel",
        "dequantize fp8_tensorwise: _dequantize_kernel",
        # the smoke layer's rows have three lengths: a launch each (their own register widths
        # and tile sizes)
        "quantize fp8_rowwise: _fp8_rows_kernel, _fp8_rows_kernel, _fp8_rows_kernel",
        "dequantize fp8_rowwise: _dequantize_kernel, _dequantize_kernel, _dequantize_kernel",
        "quantize nf4: _nf4_quantize_kernel",
        "dequantize nf4: _dequantize_kernel",
    ], r.stdout


def test_profile_step_gpu_smoke(tmp_path):
    """benchmarks/profile_step_gpu.py on CPU: both implementations timed and profiled, each
    trace written, the report's rows present; the device analysis on a hand-made trace."""
    out = tmp_path / "profile.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/profile_step_gpu.py"), "llama8b-bf16", "--smoke", "--steps", "4",
         "--profile-steps", "1", "--json", str(out), "--trace-dir", str(tmp_path)],
        env=ENV, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert set(res["impls"]) == {"torch", "fsdp_native"}
    for impl, r in res["impls"].items():
        assert r["step_ms"] > 0 and 0 < r["host_ms"] <= r["step_ms"] * 1.5, (impl, r)
        assert r["top_self_cpu_ms"], impl
        assert (tmp_path / f"trace_llama8b-bf16_{impl}.json.gz").stat().st_size > 0
    assert "Optimizer.step#AdamW.step" in res["impls"]["torch"]["host_ms_by_annotation"]
    assert "| step (median) |" in proc.stdout
    # launches on a CPU: the calls of each library's packing ops, counted per step
    assert res["impls"]["torch"]["launches_per_step"].get("fsdp::all_gather_copy_in", 0) > 0, res["impls"]["torch"]
    assert res["impls"]["fsdp_native"]["launches_per_step"].get("fsdp_native::all_gather_copy_out", 0) > 0, res["impls"]["fsdp_native"]
    assert "| launches per step: `aten::copy_` |" in proc.stdout

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from profile_step_gpu import analyze_trace
    finally:
        sys.path.pop(0)
    # two kernels with a 100 us gap inside "Optimizer.step#AdamW.step", then a 10 us one
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "k1", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "k2", "ts": 200, "dur": 50},
        {"ph": "X", "cat": "gpu_memcpy", "name": "c", "ts": 260, "dur": 40},
        {"ph": "X", "cat": "user_annotation", "name": "Optimizer.step#AdamW.step", "ts": 90, "dur": 120},
        {"ph": "X", "cat": "user_annotation", "name": "FSDP::all_gather (blocks.0)", "ts": 0, "dur": 60},
    ]}
    a = analyze_trace(trace, steps=1)
    assert (a["device_span_ms"], a["device_busy_ms"]) == (0.3, 0.19), a
    # a kernel that starts first and ends last spans the whole trace
    b = analyze_trace({"traceEvents": [{"ph": "X", "cat": "kernel", "name": "long", "ts": 0, "dur": 500},
                                       {"ph": "X", "cat": "kernel", "name": "short", "ts": 100, "dur": 10}]}, steps=1)
    assert (b["device_span_ms"], b["device_busy_ms"], b["device_idle_ms"]) == (0.5, 0.5, 0.0), b
    assert a["idle_gaps_ms_by_annotation"] == {"Optimizer.step#AdamW.step": 0.1}, a
    assert a["host_ms_by_annotation"] == {"Optimizer.step#AdamW.step": 0.12, "FSDP::all_gather": 0.06}, a
    assert a["launches_per_step"] == {"gpu_memcpy": 1.0, "kernel": 2.0}, a


def test_tune_quant_gpu_smoke(tmp_path):
    """benchmarks/tune_quant_gpu.py on CPU (Triton interpreted, the smoke layer over 2 ranks):
    the "nf4 dequantize" group times its op under the default launch shapes and one other
    setting (other tiles), and finds the NF4 ops' bits the same under both (--smoke checks the
    formats of the group's ops; on a GPU every format's). (The three-op "dequantize" group took
    65 s here, mostly fp8_rowwise's small interpreted tiles: 13 s a dequantize.) In the same
    run, --against times another kernels/quant.py, here one with the NF4 quantize's nibbles
    planted the wrong way round: it is timed beside this one, and its bits are found to
    differ, which fails the run."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    out = tmp_path / "tune.json"
    src = (ROOT / "kernels" / "quant.py").read_text()
    right = "byte = ((hi4 << 4) | lo4).to(tl.uint8)"
    assert src.count(right) == 1
    (tmp_path / "planted.py").write_text(src.replace(right, "byte = ((lo4 << 4) | hi4).to(tl.uint8)"))
    r = subprocess.run(triton_interpreter.command(str(ROOT / "benchmarks" / "tune_quant_gpu.py"), "--smoke", "--groups", "nf4 dequantize",
                                                 "--against", str(tmp_path / "planted.py"), "--against-ops", "quantize nf4",
                                                 "--json", str(out)),
                       env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-3000:]
    assert "[tune] settings that changed a result: ['--against planted']" in r.stdout, r.stdout[-2000:]
    res = json.loads(out.read_text())
    from benchmarks.tune_quant_gpu import groups

    ab = res["against"]
    assert ab["labels"] == ["this", "planted"] and ab["same_bits"] == {"this": True, "planted": False}, ab
    assert list(ab["ops"]) == ["quantize nf4"], ab
    row = ab["ops"]["quantize nf4"]
    assert row["floor_us"] > 0 and all(row[k]["us"] > 0 and row[k]["of_floor"] > 0 for k in ab["labels"]), row
    assert "| quantize nf4 | " in r.stdout, r.stdout
    assert list(res["groups"]) == ["nf4 dequantize"]
    for name, rows in res["groups"].items():
        ops, settings = groups(True)[name]
        assert [row["setting"] for row in rows] == ["default", json.loads(json.dumps(settings[0]))], rows
        for row in rows:
            assert row["same_bits"] is True, row
            assert sorted(row["ops"]) == sorted(ops) and all(v["us"] > 0 and v["floor_us"] > 0 for v in row["ops"].values()), row
    assert "| nf4 dequantize | dequantize nf4 |" in r.stdout, r.stdout
