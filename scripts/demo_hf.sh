#!/usr/bin/env bash
# make demo-hf: the Hugging Face Trainer (fsdp=True, the HF docs' fsdp_config) training a small
# Llama with fsdp_native on 2 CPU ranks (gloo). Nothing is downloaded.
# Extra arguments go to scripts/demo_hf.py (e.g. --impl torch, --steps 200, --bf16).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export HF_HUB_OFFLINE=1
exec .venv/bin/torchrun --standalone --nproc_per_node 2 scripts/demo_hf.py "$@"
