"""Run by tests/test_torchtune.py under torchrun: one of torchtune's own recipe scripts (shipped
in its wheel as ``recipes/<name>.py``), as ``tune run`` runs it, with torch FSDP2 or, for
``FSDP_IMPL=fsdp_native``, with fsdp_native bound where torchtune imports FSDP2 from (the user's
one-import change in ``torchtune/training/_distributed.py``).

    python -m torch.distributed.run --nproc-per-node 2 tests/torchtune_recipe.py RECIPE --config YAML [key=value ...]

The recipes assume CUDA in three places, changed here for the CPU:
* ``init_process_group("cuda:nccl,cpu:gloo")``: a CPU build of torch has no NCCL, so gloo;
* ``training.get_memory_stats`` raises on CPU, and the LoRA recipe calls it unconditionally
  after loading the model: no memory stats;
* ``training.cleanup_before_training`` empties and resets the CUDA caching allocator: a
  ``gc.collect()``.
Rank 0 prints ``fully_shard calls (IMPL): N`` at exit.

    python tests/torchtune_recipe.py --make-assets DIR

writes what the recipes read, made here (no download): a SentencePiece tokenizer trained on
random text (``tokenizer.model``), a tiny Llama as a Hugging Face checkpoint (``ckpt/``: 2 layers,
dim 256, vocab 128; torchao's ``to_nf4`` takes tensors of whole 64 x 256-value blocks), a text
dataset of rows longer than the recipes' 64-token limit (every batch 64 tokens long on every
rank: the chunked output loss calls the output layer once per chunk, and ``torch.chunk``
splits 49 tokens, or some shorter lengths, into fewer than 8 chunks, so ranks with such
batches would run fewer all-gathers) and a preference dataset for DPO.
"""
from __future__ import annotations

import atexit
import gc
import importlib.util
import os
import runpy
import sys

import torch.distributed as dist


def _bind_fsdp(impl: str) -> None:
    import torchtune.training._distributed as tt_distributed

    if impl == "fsdp_native":
        import fsdp_native

        tt_distributed.fully_shard = fsdp_native.fully_shard
        tt_distributed.CPUOffloadPolicy = fsdp_native.CPUOffloadPolicy
    inner, calls = tt_distributed.fully_shard, []

    def fully_shard(module, **kwargs):
        calls.append(type(module).__name__)
        return inner(module, **kwargs)

    def report() -> None:
        if os.environ.get("RANK") == "0":
            print(f"fully_shard calls ({impl}): {len(calls)}", flush=True)

    tt_distributed.fully_shard = fully_shard
    atexit.register(report)


def _on_cpu() -> None:
    import torchtune.training as tt_training

    init_process_group = dist.init_process_group
    dist.init_process_group = lambda backend=None, *args, **kwargs: init_process_group("gloo", *args, **kwargs)
    tt_training.get_memory_stats = lambda device: {}
    tt_training.log_memory_stats = lambda stats, *args, **kwargs: None
    tt_training.cleanup_before_training = gc.collect


def make_assets(out: str) -> None:
    import json
    import random

    import sentencepiece as spm
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    os.makedirs(out, exist_ok=True)
    rng = random.Random(0)
    words = "the quick brown fox jumps over lazy dog alpha beta gamma delta shard gather reduce scatter".split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 40))) for _ in range(400)]
    with open(os.path.join(out, "corpus.txt"), "w") as f:
        f.write("\n".join(lines))
    spm.SentencePieceTrainer.train(
        input=os.path.join(out, "corpus.txt"), model_prefix=os.path.join(out, "tokenizer"), vocab_size=128,
        model_type="bpe", bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2,
    )  # fmt: skip
    rows = [" ".join(lines[i : i + 4]) for i in range(64)]
    with open(os.path.join(out, "text.json"), "w") as f:
        json.dump([{"text": r} for r in rows], f)
    turn = lambda user, answer: [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]  # noqa: E731
    pref = [{"chosen": turn(r[:80], r[80:200]), "rejected": turn(r[:80], rows[i + 1][80:160])} for i, r in enumerate(rows[:-1])]
    with open(os.path.join(out, "preference.json"), "w") as f:
        json.dump(pref, f)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
    )  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(os.path.join(out, "ckpt"), safe_serialization=True)


def main() -> None:
    if sys.argv[1] == "--make-assets":
        make_assets(sys.argv[2])
        return
    impl = os.environ.get("FSDP_IMPL", "torch")
    if impl not in ("torch", "fsdp_native"):
        raise ValueError(f"FSDP_IMPL must be 'torch' or 'fsdp_native', got {impl!r}")
    _bind_fsdp(impl)
    _on_cpu()
    recipe = sys.argv[1]
    root = os.path.dirname(os.path.dirname(importlib.util.find_spec("torchtune").origin))
    path = os.path.join(root, "recipes", f"{recipe}.py")
    sys.argv = [path] + sys.argv[2:]
    runpy.run_path(path, run_name="__main__")


if __name__ == "__main__":
    main()
