"""Cost of fsdp_native's trace recorder when it is off (the default).

With no recorder active, every call site of the runtime pays one module-attribute read and a
None test. This script counts those reads over one training step of the overhead-bound model
(33 units, 1 rank, gloo) and times one read, giving the cost per step; compare it with the step
time (tens of milliseconds): it is far below the run-to-run noise.

    .venv/bin/python benchmarks/bench_trace_off.py
"""
import os
import sys
import timeit

import torch
import torch.distributed as dist

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks import harness as H  # noqa: E402
from benchmarks.models import MODEL_CONFIGS, build_model, shard_model  # noqa: E402


class _CountingModule:
    """Stands in for the `_trace` module in the runtime and counts attribute reads."""

    def __init__(self, module) -> None:
        object.__setattr__(self, "module", module)
        object.__setattr__(self, "reads", 0)

    def __getattr__(self, name):
        object.__setattr__(self, "reads", self.reads + 1)
        return getattr(self.module, name)


def main() -> None:
    H.init_single_process_group("gloo")
    import fsdp_native
    from fsdp_native import _reduce, _state, _trace, _unit

    counter = _CountingModule(_trace)
    for mod in (_unit, _state, _reduce):
        mod._trace = counter
    cfg = MODEL_CONFIGS["overhead"]
    model = shard_model(build_model(cfg), fsdp_native.fully_shard)
    x = torch.randn(*cfg.input_shape)
    for _ in range(2):
        model(x).pow(2).mean().backward()
    counter.reads = 0
    model(x).pow(2).mean().backward()
    reads = counter.reads
    one = min(timeit.repeat("m.active is not None", globals={"m": _trace}, number=100_000, repeat=5)) / 100_000
    print(f"recorder off: {reads} checks per forward+backward, {one * 1e9:.0f} ns each, {reads * one * 1e6:.1f} us per step")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
