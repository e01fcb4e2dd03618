"""TRL's trainers with FSDP2 (``fsdp=True`` and the Hugging Face docs' ``fsdp_config``, version
2), on fsdp_native through ``use_with_accelerate(cpu=True)`` against torch FSDP2, 2 CPU ranks,
a tiny Llama (no Hub) and a word-level tokenizer built here. TRL adds two paths of its own on
top of the Trainer's:

* **a reference model** sharded by TRL's ``prepare_fsdp``, which imports ``fully_shard`` from
  ``torch.distributed.fsdp`` when it is called and shards the whole model as one unit (no
  auto-wrap), in eval mode, forward only under ``no_grad``;
* **DPO** with ``sync_ref_model=True``: after each step ``SyncRefModelCallback`` mixes the
  policy's sharded parameters into the reference's in place (``p.data.mul_().add_()``), so
  the next reference forward must gather the updated shards;
* **GRPO**: completions sampled with ``generate()`` through the sharded policy in the training
  loop, rewards from a function, and with ``beta > 0`` a reference model that TRL loads from
  the policy's path and prepares as above;
* **SFT with FSDP-QLoRA**: the model loaded from a path in 4 bits through ``model_init_kwargs``
  (bitsandbytes, bf16 quant storage, so the packed weights are sharded) and LoRA adapters from
  ``peft_config``, as the TRL and bitsandbytes docs set it up.

Each run must give torch FSDP2's losses, sampled completions, trained parameters and (DPO)
reference parameters bit for bit, and every FSDP unit, the reference's included, must be the
library's under test."""
from __future__ import annotations

import os

import pytest

from dist_utils import ctx, full_params, run_distributed, run_grid
from test_hf_common import (
    VOCAB, as_bits, assert_same, bnb_4bit_config, check_impl, impl_handle, reset_accelerate, set_launcher_env, tiny_llama,
    tiny_llama_dir,
)
from test_hf_trainer import fsdp_config

pytest.importorskip("trl", reason="trl is a test dependency (make test installs it)")

STEPS = 2


def _tokenizer():
    """A word-level tokenizer over the tiny Llama's vocabulary: "w0" .. "w92", pad and EOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[PAD]", "[UNK]", "[EOS]"] + [f"w{i}" for i in range(VOCAB - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]")


def _words(r, n: int) -> str:
    return " ".join(f"w{r.randrange(VOCAB - 3)}" for _ in range(n))


def _args(config_cls, impl: str, **kw):
    return config_cls(
        output_dir=os.path.join(ctx().tmpdir, f"{config_cls.__name__}-{impl}"),
        fsdp=True,
        fsdp_config=fsdp_config(),
        use_cpu=True,
        per_device_train_batch_size=2,
        max_steps=STEPS,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        logging_strategy="no",
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
        **kw,
    )


def _recording(trainer_cls, recorded: list, key: str | None = None):
    """``trainer_cls`` that records each training loss (and ``inputs[key]``)."""

    class Recording(trainer_cls):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
            recorded.append((out[0] if return_outputs else out).detach().float().clone())
            if key is not None:
                recorded.append(inputs[key].clone())
            return out

    return Recording


def _units(model) -> int:
    from torch.distributed.fsdp import FSDPModule

    return sum(isinstance(m, FSDPModule) for m in model.modules())


def dpo_run(impl: str):
    """DPOTrainer with an explicit reference model, mixed into by the policy after every step."""
    import random

    import torch.distributed as dist
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    reset_accelerate()
    r = random.Random(7)
    data = Dataset.from_list(
        [{"prompt": _words(r, 4) + " ", "chosen": _words(r, 3), "rejected": _words(r, 3)} for _ in range(2 * dist.get_world_size() * STEPS)]
    )
    recorded: list = []
    with impl_handle(impl):
        args = _args(DPOConfig, impl, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5, max_length=16)
        trainer = _recording(DPOTrainer, recorded)(
            model=tiny_llama(0), ref_model=tiny_llama(0), args=args, train_dataset=data, processing_class=_tokenizer()
        )
        trainer.train()
        check_impl(trainer.model, impl)
        check_impl(trainer.ref_model, impl)
        assert _units(trainer.ref_model) == 1, f"prepare_fsdp made {_units(trainer.ref_model)} units, expected the root only"
        out = recorded, full_params(trainer.model), full_params(trainer.ref_model)
        trainer.accelerator.free_memory()
    assert len(recorded) == STEPS, len(recorded)
    return out


def _reward(completions, **kwargs):
    return [float(len(set(c.split()))) for c in completions]


def grpo_run(impl: str):
    """GRPOTrainer, bf16, 2 sampled completions per prompt, a reference model (beta > 0)."""
    import random

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    reset_accelerate()
    path = tiny_llama_dir()
    r = random.Random(7)
    data = Dataset.from_list([{"prompt": _words(r, 4)} for _ in range(16)])
    recorded: list = []
    with impl_handle(impl):
        args = _args(GRPOConfig, impl, num_generations=2, max_completion_length=4, beta=0.04, bf16=True)
        trainer = _recording(GRPOTrainer, recorded, key="completion_ids")(
            model=path, reward_funcs=[_reward], args=args, train_dataset=data, processing_class=_tokenizer()
        )
        trainer.train()
        check_impl(trainer.model, impl)
        assert trainer.ref_model is not None, "beta > 0 and no reference model"
        check_impl(trainer.ref_model, impl)
        out = recorded, full_params(trainer.model)
        trainer.accelerator.free_memory()
    assert len(recorded) == 2 * STEPS, len(recorded)
    return out


def sft_qlora_run(impl: str):
    """SFTTrainer, FSDP-QLoRA as the TRL and bitsandbytes docs set it up: the model loaded from a
    path in 4 bits (``model_init_kwargs`` with a bf16 ``bnb_4bit_quant_storage``), LoRA adapters
    from ``peft_config``, bf16."""
    import random

    import torch
    import torch.distributed as dist
    from datasets import Dataset
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    reset_accelerate()
    path = tiny_llama_dir()
    r = random.Random(7)
    data = Dataset.from_list([{"text": _words(r, 10)} for _ in range(2 * dist.get_world_size() * STEPS)])
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    recorded: list = []
    with impl_handle(impl):
        torch.manual_seed(0)  # the adapters' initialisation
        args = _args(SFTConfig, impl, max_length=16, bf16=True, model_init_kwargs={"quantization_config": bnb_4bit_config(), "dtype": torch.bfloat16})
        trainer = _recording(SFTTrainer, recorded)(
            model=path, args=args, train_dataset=data, processing_class=_tokenizer(), peft_config=lora
        )
        trainer.train()
        check_impl(trainer.model, impl)
        params = full_params(trainer.model)
        packed = [n for n in params if "base_layer" in n and params[n].dtype == torch.bfloat16]
        assert packed and all(params[n].shape[-1] == 1 for n in packed), packed  # Params4bit
        params = as_bits(params)
        trainer.accelerator.free_memory()
    assert len(recorded) == STEPS, len(recorded)
    return recorded, params


def _parity(flow: str):
    run = {"dpo": dpo_run, "grpo": grpo_run, "sft-qlora": sft_qlora_run}[flow]
    ref, got = run("torch"), run("native")
    assert_same("losses (and completions)", got[0], ref[0])
    assert_same("parameters", got[1], ref[1])
    if flow == "dpo":
        assert_same("reference parameters", got[2], ref[2])


def _grid():
    set_launcher_env()
    run_grid([dict(flow="dpo"), dict(flow="grpo"), dict(flow="sft-qlora")], _parity, name="trl")


def test_trl_dpo_grpo_and_sft_qlora_parity_ws2():
    run_distributed(_grid, 2, timeout=400)
