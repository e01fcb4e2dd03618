"""The Transformers Trainer (fsdp=True with the fsdp_config of the Hugging Face FSDP2 docs) on
fsdp_native vs on torch FSDP2: a tiny Llama from a LlamaConfig (no Hub) on 2 CPU ranks, both
libraries in the same spawn, bitwise equal losses and parameters; generate() after training
(the Trainer registers it with register_fsdp_forward_method); torch_compile=True; checkpoints
written during training and resume_from_checkpoint, across the two libraries; cpu_offload;
load_best_model_at_end (an earlier checkpoint loaded after training)."""
from __future__ import annotations

import os

from dist_utils import ctx, full_params, run_distributed, run_grid
from test_hf_common import (
    HF_PRELOAD,
    SEQ,
    VOCAB,
    assert_same,
    check_impl,
    impl_handle,
    reset_accelerate,
    set_launcher_env,
    tiny_llama,
)

STEPS = 3


def _dataset(n: int, seed: int = 4321):
    import torch

    class Tokens(torch.utils.data.Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(seed)
            self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

        def __len__(self):
            return n

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    return Tokens()


def fsdp_config(**overrides):
    """The fsdp_config of the Hugging Face FSDP2 docs (hf-transformers-fsdp2.md)."""
    cfg = {
        "version": 2,
        "reshard_after_forward": True,
        "cpu_offload": False,
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
        "state_dict_type": "FULL_STATE_DICT",
        "cpu_ram_efficient_loading": False,
        "activation_checkpointing": False,
    }
    cfg.update(overrides)
    return cfg


def lora_llama(seed: int = 0):
    """The tiny Llama with PEFT LoRA adapters (rank 4) on the attention and MLP projections:
    the base weights frozen, the adapters trainable, in the same decoder-layer units."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"])
    return get_peft_model(tiny_llama(seed), cfg)


def trainer_run(
    impl,
    *,
    bf16=False,
    ga=1,
    use_cpu=True,
    generate=False,
    torch_compile=False,
    lora=False,
    all_gather=None,
    save_dir=None,
    on_trained=None,
    gradient_checkpointing=False,
    gradient_checkpointing_kwargs=None,
    model_dtype=None,
    max_steps=STEPS,
    output_dir=None,
    save_steps=None,
    resume=None,
    eval_steps=None,
    model_fn=None,
    args_overrides=None,
    **cfg_overrides,
):
    """Trainer.train for ``max_steps`` optimizer steps; returns (per-micro-batch losses, full params,
    generated tokens or None). ``lora``: a PEFT LoRA model; ``all_gather``: fsdp_native's
    quantized all-gather for the decoder layers; ``save_dir``: Trainer.save_model there after
    training; ``on_trained(trainer)`` runs last. ``save_steps``: a checkpoint every that many
    steps under ``output_dir``; ``resume``: the checkpoint to resume from; ``eval_steps``: the
    Trainer evaluates on a held-out set every that many steps (``trainer.state.log_history``);
    ``model_fn()``: builds the model instead (after the TrainingArguments, as a script does);
    ``args_overrides``: more TrainingArguments."""
    import torch
    import torch.distributed as dist
    from transformers import Trainer, TrainingArguments

    class RecordingTrainer(Trainer):
        recorded: list

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
            loss = out[0] if return_outputs else out
            if model.training:  # not the evaluation loop's losses
                self.recorded.append(loss.detach().float().clone())
            return out

    reset_accelerate()
    rank, world = dist.get_rank(), dist.get_world_size()
    cpu_ram = bool(cfg_overrides.get("cpu_ram_efficient_loading"))
    with impl_handle(impl, all_gather):
        args = TrainingArguments(
            output_dir=output_dir or os.path.join(ctx().tmpdir, f"out-{impl}"),
            fsdp=True,
            fsdp_config=fsdp_config(**cfg_overrides),
            use_cpu=use_cpu,
            bf16=bf16,
            torch_compile=torch_compile,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=ga,
            max_steps=max_steps,
            learning_rate=1e-2,
            # with checkpoints, a schedule whose state must be saved and restored
            lr_scheduler_type="linear" if save_steps else "constant",
            warmup_steps=1 if save_steps else 0,
            logging_strategy="no",
            log_level="error",
            save_strategy="steps" if save_steps else "no",
            save_steps=save_steps or 500,
            eval_strategy="steps" if eval_steps else "no",
            eval_steps=eval_steps,
            per_device_eval_batch_size=3,
            report_to=[],
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=0,
            gradient_checkpointing=gradient_checkpointing,
            gradient_checkpointing_kwargs=gradient_checkpointing_kwargs,
            **(args_overrides or {}),
        )
        if model_fn is not None:
            model = model_fn()
        else:
            model = lora_llama() if lora else tiny_llama(seed=rank if cpu_ram else 0)
        if model_dtype is not None:
            model.to(getattr(torch, model_dtype))
        trainer = RecordingTrainer(
            model=model,
            args=args,
            train_dataset=_dataset(2 * world * ga * max_steps),
            eval_dataset=_dataset(5, seed=99) if eval_steps else None,
        )
        trainer.recorded = []
        trainer.train(resume_from_checkpoint=resume)
        assert trainer.is_fsdp_enabled, "the Trainer did not run FSDP"
        check_impl(trainer.model, impl)
        params = full_params(trainer.model)
        tokens = None
        if generate:
            # Trainer.train registered generate with register_fsdp_forward_method.
            assert hasattr(trainer.model.generate, "__wrapped__"), "generate is not registered as an FSDP forward method"
            prompt = torch.arange(6).reshape(1, 6) % VOCAB
            with torch.no_grad():
                tokens = trainer.model.generate(input_ids=prompt, max_new_tokens=4, do_sample=False, use_cache=False)
            assert tokens.shape == (1, 10), tokens.shape
        if save_dir is not None:
            trainer.save_model(save_dir)
        if on_trained is not None:
            on_trained(trainer)
        losses = trainer.recorded
        trainer.accelerator.free_memory()
    return losses, params, tokens


def _parity(**cfg):
    ref = trainer_run("torch", **cfg)
    got = trainer_run("native", **cfg)
    assert len(ref[0]) == STEPS * cfg.get("ga", 1), len(ref[0])
    assert_same("losses", got[0], ref[0])
    assert_same("parameters", got[1], ref[1])
    if cfg.get("generate"):
        assert_same("generated tokens", got[2], ref[2])


def _size_based(**cfg):
    """auto_wrap_policy SIZE_BASED_WRAP (the Hugging Face docs' other policy): Accelerate's
    FSDP2 policy chooses every module of more than min_num_params parameters, the decoder's
    layer list too, which torch FSDP2 refuses ("fully_shard does not support containers that do
    not implement forward"); the integrations leave the list out.
    Accelerate's carving of the final norm and output layer into a unit then failed too, as the
    policy had chosen the base model holding them; the integrations leave both out
    (fsdp_native.integrations._without_containers). Units: every decoder layer and the modules in
    it over the threshold, the embedding, the carved tail; not the list nor the base model. The
    same in both libraries, and bit for bit torch FSDP2's losses and parameters; with
    activation checkpointing too (Accelerate checkpoints every module the policy chooses)."""
    from torch.distributed.fsdp import FSDPModule

    units = {}
    for impl in ("torch", "native"):
        units[impl] = []
        record = lambda t, into=units[impl]: into.extend(  # noqa: E731
            n.replace("._checkpoint_wrapped_module", "") for n, m in t.model.named_modules() if isinstance(m, FSDPModule)
        )
        units[impl + "-run"] = trainer_run(impl, auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=2000,
                                           transformer_layer_cls_to_wrap=None, on_trained=record, **cfg)
    got = units["native"]
    assert got == units["torch"], f"units: {got} vs torch FSDP2's {units['torch']}"
    assert "model.layers" not in got and "model" not in got, got  # the list, and the base model holding the carved modules
    for unit in ("model.layers.0", "model.layers.1.mlp.down_proj", "model.embed_tokens", "model.norm", "lm_head"):
        assert unit in got, f"no unit {unit!r}: {got}"
    assert_same("losses", units["native-run"][0], units["torch-run"][0])
    assert_same("parameters", units["native-run"][1], units["torch-run"][1])


def _trainer_grid():
    set_launcher_env()
    configs = [
        dict(gradient_checkpointing=True),
        dict(gradient_checkpointing=True, bf16=True, model_dtype="bfloat16"),
        # use_reentrant=True: transformers 4.x's default, and many QLoRA recipes'. transformers 5
        # checkpoints each decoder layer's forward, inside FSDP's hooks; 4.x checkpointed its
        # __call__, hooks included, which tests/test_activation_checkpointing.py covers.
        dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True}),
        dict(use_cpu=False),  # fp32; CPU chosen through use_with_accelerate(cpu=True) alone
        dict(bf16=True),
        dict(bf16=True, ga=2),
        dict(activation_checkpointing=True),
        dict(cpu_ram_efficient_loading=True),
        dict(generate=True),
        dict(torch_compile=True, bf16=True),  # Accelerate compiles the sharded model (inductor on CPU)
    ]
    run_grid(configs, _parity, name="trainer")
    run_grid([dict(), dict(bf16=True, activation_checkpointing=True)], _size_based, name="SIZE_BASED_WRAP")


def test_trainer_parity_ws2():
    run_distributed(_trainer_grid, 2, timeout=400, preload=HF_PRELOAD)


# --------------------------------------------------------------------------------------------
# Checkpoints written during training, resume_from_checkpoint, CPU offload
# --------------------------------------------------------------------------------------------
CKPT_STEPS = 4  # a checkpoint after step 2, resumed to step 4


def _eval_losses(into: list):
    return lambda trainer: into.extend(h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h)


def _resume(**cfg):
    """save_strategy="steps" (every 2 steps, with evaluation), then a new Trainer resumes from
    checkpoint-2 through the Trainer's own path (Accelerate's load_fsdp_model /
    load_fsdp_optimizer, the scheduler, the RNG states, the data skipped). Each library's
    uninterrupted run must equal the other's, and a resumed run must finish where the
    uninterrupted one did: fsdp_native from its own checkpoint and from torch FSDP2's, torch
    FSDP2 from fsdp_native's."""
    base = ctx().tmpdir
    tag = "-".join(f"{k}={v}" for k, v in sorted(cfg.items()))
    run = dict(cfg, max_steps=CKPT_STEPS, save_steps=2)
    full, evals = {}, {}
    for impl in ("torch", "native"):
        evals[impl] = []
        full[impl] = trainer_run(impl, output_dir=os.path.join(base, f"{impl}-{tag}"), eval_steps=2,
                                 on_trained=_eval_losses(evals[impl]), **run)
    assert len(evals["torch"]) == CKPT_STEPS // 2, evals["torch"]
    assert evals["native"] == evals["torch"], f"evaluation losses: {evals['native']} vs {evals['torch']}"
    assert_same("losses", full["native"][0], full["torch"][0])
    assert_same("parameters", full["native"][1], full["torch"][1])
    done = 2 * cfg.get("ga", 1)  # micro-batches before the checkpoint
    for impl, saver in (("native", "native"), ("native", "torch"), ("torch", "native")):
        ckpt = os.path.join(base, f"{saver}-{tag}", "checkpoint-2")
        got = trainer_run(impl, output_dir=os.path.join(base, f"{impl}-from-{saver}-{tag}"), resume=ckpt, **run)
        what = f"{impl} resumed from {saver}'s checkpoint-2"
        assert_same(f"{what}: losses", got[0], full["torch"][0][done:])
        assert_same(f"{what}: parameters", got[1], full["torch"][1])


def _offload_matches_torch_without(**cfg):
    """fsdp_config cpu_offload=True. Accelerate passes CPUOffloadPolicy() (pin_memory=True),
    which torch FSDP2 pins, and pinning needs an accelerator: on a CPU-only machine torch
    fails ("Cannot access accelerator device when none is available"). fsdp_native pins only
    on a CUDA mesh, so it trains, and the offload moves no number: equal to torch FSDP2 without
    offload, bit for bit."""
    ref = trainer_run("torch", cpu_offload=False, **cfg)
    got = trainer_run("native", cpu_offload=True, **cfg)
    assert_same("losses", got[0], ref[0])
    assert_same("parameters", got[1], ref[1])


def _best_model(**cfg):
    """load_best_model_at_end: checkpoints and evaluations every 2 of 6 steps, the best being
    the highest evaluation loss (greater_is_better), so checkpoint-2: after training the
    Trainer loads it through Accelerate's load_fsdp_model. Bit for bit torch FSDP2's losses,
    evaluations, choice and loaded parameters, which differ from those of the end of training."""
    base = ctx().tmpdir
    best = dict(load_best_model_at_end=True, metric_for_best_model="eval_loss", greater_is_better=True, save_total_limit=2)
    run = dict(cfg, max_steps=6, save_steps=2, eval_steps=2)
    got = {}
    import torch

    for impl, extra in (("torch", best), ("native", best), ("native-last", {})):
        evals = []

        def record(trainer, evals=evals):
            _eval_losses(evals)(trainer)
            evals.append(os.path.basename(trainer.state.best_model_checkpoint or "none"))

        out = trainer_run(impl.split("-")[0], output_dir=os.path.join(base, f"best-{impl}"), on_trained=record,
                          args_overrides=extra, **run)
        got[impl] = out, evals
    evals = got["torch"][1]
    assert len(evals) == 4 and max(evals[:3]) == evals[0] and evals[3] == "checkpoint-2", (
        f"torch FSDP2's evaluation losses and best checkpoint: {evals} (expected the first, checkpoint-2)"
    )
    assert got["native"][1] == evals, f"evaluation losses and best checkpoint: {got['native'][1]} vs {evals}"
    assert_same("losses", got["native"][0][0], got["torch"][0][0])
    assert_same("loaded parameters", got["native"][0][1], got["torch"][0][1])
    last = got["native-last"][0][1]
    assert any(not torch.equal(last[k], v) for k, v in got["native"][0][1].items()), "the best model was not loaded"


def _checkpoint_grid():
    set_launcher_env()
    run_grid([dict(bf16=True, ga=2), dict(state_dict_type="FULL_STATE_DICT")], _resume, name="resume")
    run_grid([dict(bf16=True)], _offload_matches_torch_without, name="cpu_offload")
    run_grid([dict()], _best_model, name="load_best_model_at_end")


def test_trainer_checkpoints_resume_and_cpu_offload_ws2():
    run_distributed(_checkpoint_grid, 2, timeout=400, preload=HF_PRELOAD)
