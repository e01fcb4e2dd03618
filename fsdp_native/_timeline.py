"""Timeline PNG from the Chrome traces written by :func:`fsdp_native.record_trace`."""
from __future__ import annotations

import json

from fsdp_native._trace import LANES

_COLORS = {
    "compute": "#4c72b0",
    "all_gather": "#55a868",
    "reduce_scatter": "#8172b2",
    "all_reduce": "#ccb974",
    "copy": "#64b5cd",
    "stall": "#c44e52",
}


def plot_timeline(trace_paths: list[str], png_path: str, *, title: str = "", step: int | None = None) -> str:
    """Draws one lane per activity and rank from per-rank Chrome trace files; stalls (compute
    waiting on communication) are red. `step` limits the plot to one step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []
    for path in trace_paths:
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
        if step is not None:
            events = [e for e in events if e["args"].get("step") == step]
        rows.append(events)
    t0 = min((e["ts"] for ev in rows for e in ev), default=0.0)
    lanes = [(rank, lane) for rank in range(len(rows)) for lane in LANES]
    fig, ax = plt.subplots(figsize=(14, 0.35 * len(lanes) + 1.2))
    for y, (rank, lane) in enumerate(lanes):
        spans = [((e["ts"] - t0) / 1e3, e["dur"] / 1e3) for e in rows[rank] if e["cat"] == lane]
        if spans:
            ax.broken_barh(spans, (y - 0.4, 0.8), facecolors=_COLORS[lane], edgecolor="none")
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([f"rank {r} {lane}" for r, lane in lanes], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path
