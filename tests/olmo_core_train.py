"""Run by tests/test_olmo_core.py under torchrun: OLMo-core's own training stack (its
``TransformerConfig.llama_like`` model built on the meta device, ``TransformerTrainModule``, which
applies FSDP with ``Transformer.apply_fsdp``, its numpy data loader, ``Trainer`` and
``CheckpointerCallback``) for 4 steps, with torch FSDP2 and with fsdp_native, for each wrapping
strategy given, one after the other in these processes.

    python -m torch.distributed.run --nproc-per-node 2 tests/olmo_core_train.py OUT full fine_grained ...

fsdp_native goes where OLMo-core imports FSDP2 from (``olmo_core/nn/transformer/model.py`` and
``block.py``: ``fully_shard`` and ``MixedPrecisionPolicy``). Rank 0 then writes
``OUT/results.json``: per run, the metrics the trainer logged at every step (losses, gradient
norm, learning rate; not timings), the ``fully_shard`` calls, and the final checkpoint unsharded
with OLMo-core's ``unshard_checkpoint`` (model and optimizer state), as a digest per tensor.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys

import numpy as np
import torch
import torch.distributed.fsdp as torch_fsdp

import fsdp_native

SEQ, STEPS, VOCAB = 128, 4, 512
# Each implementation's names, taken before _bind rebinds torch's MixedPrecisionPolicy: a torch
# run after an fsdp_native one must get torch's own class back.
IMPLS = {
    "torch": (torch_fsdp.fully_shard, torch_fsdp.MixedPrecisionPolicy),
    "fsdp_native": (fsdp_native.fully_shard, fsdp_native.MixedPrecisionPolicy),
}


def _bind(impl: str, calls: list) -> None:
    import olmo_core.nn.transformer.block as olmo_block
    import olmo_core.nn.transformer.model as olmo_model

    shard, policy = IMPLS[impl]

    def fully_shard(module, **kwargs):
        calls.append(type(module).__name__)
        return shard(module, **kwargs)

    for mod in (olmo_model, olmo_block):
        mod.fully_shard = fully_shard
    # model.py imports MixedPrecisionPolicy at the top, block.py inside a function
    olmo_model.MixedPrecisionPolicy = torch_fsdp.MixedPrecisionPolicy = policy


def _digest(t) -> str | float | int:
    if isinstance(t, torch.Tensor):
        t = t.detach().contiguous().cpu()
        return f"{t.dtype}{list(t.shape)}:" + hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
    return t if isinstance(t, (int, float, str)) else repr(t)


def _flat(d, prefix: str = "") -> dict:
    items = d.items() if isinstance(d, dict) else enumerate(d)
    out = {}
    for k, v in items:
        if isinstance(v, (dict, list, tuple)):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = _digest(v)
    return out


def train(out: str, impl: str, wrapping: str, data: str) -> dict:
    from olmo_core.config import DType
    from olmo_core.data import NumpyDataLoaderConfig, NumpyFSLDatasetConfig, TokenizerConfig
    from olmo_core.distributed.parallel import DataParallelType
    from olmo_core.nn.transformer import TransformerConfig, TransformerDataParallelWrappingStrategy
    from olmo_core.optim import AdamWConfig, CosWithWarmup
    from olmo_core.train import Duration, TrainerConfig
    from olmo_core.train.callbacks import Callback, CheckpointerCallback
    from olmo_core.train.train_module import TransformerDataParallelConfig, TransformerTrainModuleConfig
    from olmo_core.utils import seed_all

    rows, calls = [], []

    class Record(Callback):
        def log_metrics(self, step, metrics):
            kept = {k: float(v) for k, v in metrics.items() if not any(s in k.lower() for s in ("duration", "throughput", "time"))}
            if kept:
                rows.append({"step": step, **kept})

    _bind(impl, calls)
    import olmo_core.distributed.parallel as olmo_parallel

    olmo_parallel._WORLD_MESH = None  # built once per process by OLMo-core; each run here builds its own
    seed_all(0)
    model = TransformerConfig.llama_like(d_model=128, vocab_size=VOCAB, n_layers=2, n_heads=4).build(init_device="meta")
    dp = TransformerDataParallelConfig(
        name=DataParallelType.fsdp, param_dtype=DType.bfloat16, reduce_dtype=DType.float32,
        wrapping_strategy=TransformerDataParallelWrappingStrategy(wrapping), prefetch_factor=1,
    )  # fmt: skip
    train_module = TransformerTrainModuleConfig(
        rank_microbatch_size=2 * SEQ, max_sequence_length=SEQ, optim=AdamWConfig(lr=1e-3), max_grad_norm=1.0,
        scheduler=CosWithWarmup(warmup_steps=2), dp_config=dp,
    ).build(model)  # fmt: skip
    tokenizer = TokenizerConfig(vocab_size=VOCAB, eos_token_id=0, pad_token_id=1)
    run = os.path.join(out, f"{wrapping}-{impl}")
    dataset = NumpyFSLDatasetConfig(paths=[data], sequence_length=SEQ, tokenizer=tokenizer, work_dir=os.path.join(run, "work"))
    # 8 sequences a step: 4 per rank, in 2 micro-batches of 2 (gradient accumulation)
    loader = NumpyDataLoaderConfig(global_batch_size=8 * SEQ, seed=0, num_workers=0).build(
        dataset.build(), dp_process_group=train_module.dp_process_group
    )
    trainer = (
        TrainerConfig(save_folder=os.path.join(run, "save"), save_overwrite=True, metrics_collect_interval=1,
                      max_duration=Duration.steps(STEPS))  # fmt: skip
        .with_callback("record", Record())
        .with_callback("checkpointer", CheckpointerCallback(save_interval=STEPS, ephemeral_save_interval=None, save_async=False))
        .build(train_module, loader)
    )
    trainer.fit()
    return {"metrics": rows, "calls": len(calls), "checkpoint": os.path.join(run, "save", f"step{STEPS}", "model_and_optim")}


def main() -> None:
    import torch.distributed as dist
    from olmo_core.distributed.checkpoint import unshard_checkpoint
    from olmo_core.train import prepare_training_environment, teardown_training_environment

    out, wrappings = sys.argv[1], sys.argv[2:]
    prepare_training_environment(backend="gloo")  # its default adds "cuda:nccl": no NCCL in a CPU build
    data = os.path.join(out, "tokens.npy")
    if dist.get_rank() == 0:
        tokens = np.random.default_rng(0).integers(2, VOCAB, 64 * 1024)
        np.memmap(data, dtype=np.uint16, mode="w+", shape=tokens.shape)[:] = tokens
    dist.barrier()
    runs = {f"{w}-{impl}": train(out, impl, w, data) for w in wrappings for impl in ("torch", "fsdp_native")}
    rank = dist.get_rank()
    teardown_training_environment()
    if rank == 0:  # unshard_checkpoint runs outside a process group
        for name, r in runs.items():
            model, optim = unshard_checkpoint(r.pop("checkpoint"), os.path.join(out, f"{name}-unsharded"), optim=True, quiet=True)
            r["checkpoint"] = {"model": _flat(torch.load(model, weights_only=False)), "optim": _flat(torch.load(optim, weights_only=False))}
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(runs, f)


if __name__ == "__main__":
    main()
