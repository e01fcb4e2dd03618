"""The Hugging Face Trainer on fsdp_native: a small Llama (built from a LlamaConfig, nothing
downloaded) trained with ``fsdp=True`` and the fsdp_config of the Hugging Face FSDP2 docs, on
CPU ranks (gloo) or GPUs.

    .venv/bin/torchrun --standalone --nproc_per_node 2 scripts/demo_hf.py [--impl torch] [--steps N] [--bf16] [--gpu]

Task: copy. Each sequence is a random half of HALF tokens followed by the same half again; the
loss is over the whole sequence, so it starts near ln(VOCAB) and falls towards half of that
once the model learns to copy. At the end the model generates the second half of a prompt.
"""
from __future__ import annotations

import argparse
import math
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

VOCAB, HALF = 64, 12

# The fsdp_config of the Hugging Face FSDP2 docs.
FSDP_CONFIG = {
    "version": 2,
    "reshard_after_forward": True,
    "cpu_offload": False,
    "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
    "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
    "state_dict_type": "FULL_STATE_DICT",
    "cpu_ram_efficient_loading": True,
    "activation_checkpointing": True,
}


class CopyTask(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        half = torch.randint(0, VOCAB, (n, HALF), generator=g)
        self.ids = torch.cat([half, half], dim=1)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", choices=["fsdp_native", "torch"], default="fsdp_native")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision")
    p.add_argument("--gpu", action="store_true", help="run on CUDA (one GPU per rank) instead of CPU")
    p.add_argument("--output-dir", default=os.path.join(os.path.dirname(__file__), "..", "checkpoints", "demo_hf"))
    args = p.parse_args()

    import fsdp_native.integrations as fi

    cpu = not args.gpu
    handle = fi.use_with_accelerate(cpu=cpu) if args.impl == "fsdp_native" else (fi.enable_accelerate_cpu_fsdp() if cpu else None)

    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    training_args = TrainingArguments(
        output_dir=args.output_dir,
        fsdp=True,
        fsdp_config=FSDP_CONFIG,
        use_cpu=cpu,
        bf16=args.bf16,
        per_device_train_batch_size=8,
        max_steps=args.steps,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        logging_steps=50,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2 * HALF,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = Trainer(model=model, args=training_args, train_dataset=CopyTask(8 * world * args.steps))
    t0 = time.perf_counter()
    result = trainer.train()
    elapsed = time.perf_counter() - t0

    import fsdp_native
    from torch.distributed.fsdp import FSDPModule

    units = [n or "<root>" for n, m in trainer.model.named_modules() if isinstance(m, FSDPModule)]
    native = all(isinstance(m, fsdp_native.FSDPModule) for m in trainer.model.modules() if isinstance(m, FSDPModule))
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]

    prompt = CopyTask(1, seed=999).ids[:, : HALF + 1].to(trainer.model.device if args.gpu else "cpu")
    with torch.no_grad():
        out = trainer.model.generate(input_ids=prompt, max_new_tokens=HALF - 1, do_sample=False, use_cache=False)
    copied = (out[0, HALF + 1 :] == prompt[0, 1:HALF]).float().mean().item()

    trainer.save_model()  # FULL_STATE_DICT: one Transformers checkpoint, from rank 0
    if dist.get_rank() == 0:
        print(f"\nimplementation : {'fsdp_native' if native else 'torch'} ({len(units)} FSDP units: {', '.join(units)})")
        print(f"ranks          : {dist.get_world_size()} ({dist.get_backend()}), device {trainer.args.device}")
        print(f"loss           : {losses[0]:.3f} -> {losses[-1]:.3f} (ln(VOCAB) = {math.log(VOCAB):.3f}) over {result.global_step} steps")
        print(f"time           : {elapsed:.1f} s ({elapsed / max(result.global_step, 1) * 1e3:.0f} ms/step)")
        print(f"generate()     : {copied:.0%} of the copied half right")
        print(f"saved          : {os.path.abspath(args.output_dir)}")
    if handle is not None:
        handle.restore()


if __name__ == "__main__":
    main()
