"""Cost of fsdp_native's stall watch when nothing stalls (on by default, FSDP_NATIVE_STALL_S=300).

Per wait on a collective (CPU), ``_stall.wait`` adds a counter, a clock read and a tuple
(fsdp_native/_stall.py), and a daemon thread wakes every 0.25 s to read one attribute. This
script measures:

1. ns per wait: ``_stall.wait(work)`` against a bare ``work.wait()`` on a completed work;
2. waits per training step of the overhead-bound model (33 units, 2 ranks, gloo), so 1 x 2
   is the added time per step;
3. the step time of that model with the watch on and off (``_stall.STALL_S = 0``), in
   interleaved rounds on 2 ranks (medians; the difference is within the run-to-run noise);
4. the CPU time of the watch thread over 10 s of a busy main thread (/proc, 10 ms ticks).

    .venv/bin/python benchmarks/bench_stall_off.py [--rounds 6] [--steps 15]
"""
import argparse
import os
import statistics
import sys
import time
import timeit

os.environ.setdefault("OMP_NUM_THREADS", "1")

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks import harness as H  # noqa: E402
from benchmarks.models import MODEL_CONFIGS  # noqa: E402


class _Done:
    """A completed work."""

    pollable = True

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def per_wait_ns() -> tuple[float, float]:
    from fsdp_native import _stall

    w = _Done()
    _stall.wait(w)  # starts the watch thread
    n = 200_000
    bare = min(timeit.repeat(lambda: w.wait(), number=n, repeat=7)) / n
    watched = min(timeit.repeat(lambda: _stall.wait(w), number=n, repeat=7)) / n
    return bare * 1e9, watched * 1e9


def _thread_cpu_ms(native_id: int) -> float:
    with open(f"/proc/self/task/{native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime + stime
    return ticks * 1000 / os.sysconf("SC_CLK_TCK")


def watch_thread_cpu_ms(seconds: float = 10.0) -> float:
    from fsdp_native import _stall

    _stall.wait(_Done())
    thread = _stall._S.thread
    before = _thread_cpu_ms(thread.native_id)
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:  # a busy main thread, as in training
        x += sum(range(1000))
    return _thread_cpu_ms(thread.native_id) - before


def _rank(rank: int, world_size: int, port: int, rounds: int, steps: int) -> dict:
    H.init_pg(rank, world_size, port)
    from fsdp_native import _stall

    trainer = H.Trainer("fsdp_native", MODEL_CONFIGS["overhead"], "fp32", rank)
    for _ in range(3):
        trainer.step(record=False)
    seq = _stall._S.seq
    trainer.step(record=False)
    waits = _stall._S.seq - seq
    times = {"on": [], "off": []}
    default = _stall.STALL_S or 300
    for r in range(rounds):
        for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
            _stall.STALL_S = default if mode == "on" else 0
            trainer.times = []
            for _ in range(steps):
                trainer.step(record=True)
            times[mode] += H.max_over_ranks(trainer.times)
    return {"waits": waits, "on": times["on"], "off": times["off"]}


def _iqr(xs: list[float]) -> str:
    lo, hi = H.iqr_ms(xs)
    return f"{lo:.2f}-{hi:.2f}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=15)
    args = p.parse_args()
    print(H.describe_machine())
    bare, watched = per_wait_ns()
    print(f"1. per wait: bare work.wait() {bare:.0f} ns, _stall.wait(work) {watched:.0f} ns: +{watched - bare:.0f} ns")
    res = H.run_ranks(_rank, args.rounds, args.steps, world_size=2)
    added_us = res["waits"] * (watched - bare) / 1e3
    on, off = statistics.median(res["on"]) * 1e3, statistics.median(res["off"]) * 1e3
    print(f"2. overhead model, 2 ranks: {res['waits']} waits per step: +{added_us:.1f} us per step")
    print(
        f"3. step time, median of {len(res['on'])} steps each, interleaved: watch on {on:.2f} ms, off {off:.2f} ms "
        f"(on/off {on / off:.3f}; IQR on {_iqr(res['on'])}, off {_iqr(res['off'])} ms)"
    )
    cpu = watch_thread_cpu_ms()
    print(f"4. watch thread CPU over 10 s of a busy main thread: {cpu:.0f} ms (clock tick {1000 / os.sysconf('SC_CLK_TCK'):.0f} ms)")


if __name__ == "__main__":
    main()
