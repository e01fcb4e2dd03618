#!/usr/bin/env bash
# make demo: train a small transformer with fsdp_native on 2 CPU ranks (gloo), checkpoint with
# fsdp_native.checkpoint under checkpoints/demo; running it again resumes from the newest one.
# Extra arguments go to scripts/train_demo.py (e.g. --impl torch, --steps 200, --fresh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec .venv/bin/torchrun --standalone --nproc_per_node 2 scripts/train_demo.py "$@"
