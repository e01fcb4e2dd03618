"""OLMo-core's own training stack on fsdp_native against torch FSDP2 (``tests/olmo_core_train.py``
under torchrun, 2 gloo ranks): AI2's OLMo-core 3.0.0 ``Trainer`` with its
``TransformerTrainModule`` (bf16 parameters, fp32 reduction, gradient accumulation over two
micro-batches, ``max_grad_norm``, AdamW with a cosine warmup schedule), its model's
``apply_fsdp`` and its sharded checkpoints, 4 steps, for two of its wrapping strategies:

* ``full``: a unit per block, the embedding (``set_unshard_in_backward(False)``), the LM head
  (not resharded after forward), the root; blocks prefetch the next one explicitly
  (``set_modules_to_forward_prefetch``);
* ``fine_grained``: attention and feed-forward as units nested in each block's unit, each
  prefetching the next.

Compared: every metric the trainer logs at every step (losses, gradient norm, learning rate),
the number of ``fully_shard`` calls, and every tensor of the final checkpoint (model and
optimizer state, unsharded with OLMo-core's ``unshard_checkpoint``), bit for bit.

OLMo-core pins torch < 2.14 and cached-path's cloud storage clients; ``make venv`` installs it
and them, without touching the packages of ``.venv``, into ``.venv/olmo-core-site``, which only
the training processes put on their path.
"""
from __future__ import annotations

import json
import os

from dist_utils import framework_site, run_in_site, torchrun

HERE = os.path.dirname(os.path.abspath(__file__))
SITE = framework_site("FSDP_OLMO_CORE_SITE", "olmo-core-site", "olmo_core", "OLMo-core")
WRAPPINGS = ("full", "fine_grained")


def test_olmo_core_trainer_matches_torch_fsdp2(tmp_path):
    run_in_site(SITE, torchrun(2, os.path.join(HERE, "olmo_core_train.py"), str(tmp_path), *WRAPPINGS), "OLMo-core's training")
    with open(tmp_path / "results.json") as f:
        runs = json.load(f)
    for wrapping in WRAPPINGS:
        ref, got = runs[f"{wrapping}-torch"], runs[f"{wrapping}-fsdp_native"]
        losses = [row["train/CE loss"] for row in ref["metrics"] if "train/CE loss" in row]
        assert len(losses) == 4, ref["metrics"]
        assert got["metrics"] == ref["metrics"], f"{wrapping}: logged metrics differ:\n{ref['metrics']}\n{got['metrics']}"
        assert got["calls"] == ref["calls"] > 0, (got["calls"], ref["calls"])
        for part in ("model", "optim"):
            a, b = ref["checkpoint"][part], got["checkpoint"][part]
            assert a and a.keys() == b.keys(), sorted(set(a) ^ set(b))
            differ = [k for k in a if a[k] != b[k]]
            assert not differ, f"{wrapping}: {part} state differs from torch FSDP2's: {differ[:6]}"
