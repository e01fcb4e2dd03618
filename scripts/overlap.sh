#!/usr/bin/env bash
# Communication overlap of torch FSDP2 vs fsdp_native (benchmarks/bench_overlap.py):
# regenerates the tables (build/overlap/overlap.md, raw numbers in build/overlap/overlap.json)
# and the timelines docs/img/overlap_torch.png, docs/img/overlap_fsdp_native.png (their Chrome
# traces in build/overlap/trace/, open them in https://ui.perfetto.dev).
#
#   bash scripts/overlap.sh            # full schedule
#   bash scripts/overlap.sh --quick    # a few minutes (what BENCHMARKS.md shows)
#   make bench-overlap                 # the full schedule, after building the extension
#
# Extra arguments go to bench_overlap.py (--models, --prefetch, --reshard, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export OMP_NUM_THREADS=1
mkdir -p build/overlap docs/img
"$PY" benchmarks/bench_overlap.py \
    --timeline-dir docs/img \
    --trace-dir build/overlap/trace \
    --markdown build/overlap/overlap.md \
    --json build/overlap/overlap.json \
    "$@"
echo "tables: build/overlap/overlap.md; timelines: docs/img/overlap_torch.png docs/img/overlap_fsdp_native.png" >&2
