"""torchtune's own recipes on fsdp_native against torch FSDP2: torchtune 0.6.1's recipe scripts,
run under torchrun as ``tune run`` runs them (``tests/torchtune_recipe.py``), once with torch
FSDP2 and once with fsdp_native bound where torchtune imports ``fully_shard`` and
``CPUOffloadPolicy`` from. Its model builders, ``training.shard_model``, its
``load_from_full_model_state_dict`` (the sharded model built on the meta device, then loaded
from a Hugging Face checkpoint), its training loop, and its checkpointer, which gathers the
full state dict and writes safetensors. The model: a 2-layer Llama, bf16, 2 ranks on gloo.

In ``make test`` (about 60 s):
* ``qlora``: ``lora_finetune_distributed`` with ``quantize_base=True``: the frozen base weights
  are torchao NF4 tensors, gathered through torch's all-gather extension protocol, rank-8
  adapters on the attention and MLP projections; activation checkpointing, gradient
  accumulation, ``clip_grad_norm``, the chunked output loss; the adapter and the merged model
  saved.
* ``full_optimizer_in_bwd``: ``full_finetune_distributed`` with the embedding and the output
  layer as units of their own (``custom_sharded_layers``) and the optimizer stepped in the
  post-accumulate-gradient hooks (``optimizer_in_bwd``).

``python tests/test_torchtune.py`` runs these and the rest of what was checked by hand (same
comparison, all bit for bit): QLoRA with ``fsdp.cpu_offload``, QLoRA with ``compile=True``,
DoRA, full fine-tuning, full fine-tuning with tensor parallelism (4 ranks, 2 x 2),
quantization-aware training (``qat_distributed``: torchao's fake-quantized Linears), knowledge distillation (a sharded teacher), LoRA DPO and full DPO (a sharded reference
model).

Compared: the losses, gradient norms and learning rates torchtune logs at every step, the
number of ``fully_shard`` calls, and every tensor of every safetensors file it saves, bit for
bit.

torchtune 0.6.1 needs a torchao that still has ``torchao.dtypes.nf4tensor`` and
``int4_weight_only`` (0.15 or earlier: 0.16 dropped one, 0.17 the other) and a few tokenizer
packages; ``make venv`` installs them into ``.venv/torchtune-site``, which only the recipe
processes put on their path (the other tests use torchao 0.18).
"""
from __future__ import annotations

import glob
import os
import sys

import pytest
import torch

from dist_utils import framework_site, run_in_site, torchrun

HERE = os.path.dirname(os.path.abspath(__file__))
SITE = framework_site("FSDP_TORCHTUNE_SITE", "torchtune-site", "torchtune", "torchtune")

import yaml  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

STEPS = 4
ARCH = dict(vocab_size=128, num_layers=2, num_heads=4, num_kv_heads=4, embed_dim=256, max_seq_len=256,
            intermediate_dim=512, norm_eps=1e-5)  # fmt: skip
LORA = dict(lora_attn_modules=["q_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True, apply_lora_to_output=False,
            lora_rank=8, lora_alpha=16, lora_dropout=0.0)  # fmt: skip


def _checkpointer(assets: str) -> dict:
    return {
        "_component_": "torchtune.training.FullModelHFCheckpointer",
        "checkpoint_dir": os.path.join(assets, "ckpt"),
        "checkpoint_files": ["model.safetensors"],
        "recipe_checkpoint": None,
        "output_dir": "${output_dir}",
        "model_type": "LLAMA2",
    }


def _config(assets: str, lora: bool, preference: bool = False) -> dict:
    """A config in the shape of torchtune's llama2 7B_qlora / 7B_full ones, for the tiny model."""
    model = {"_component_": "torchtune.models.llama2.lora_llama2" if lora else "torchtune.models.llama2.llama2", **ARCH}
    if lora:
        model.update(LORA, quantize_base=False)
    if preference:
        dataset = {"_component_": "torchtune.datasets.preference_dataset", "source": "json",
                   "data_files": os.path.join(assets, "preference.json"), "split": "train"}  # fmt: skip
        loss = {"_component_": "torchtune.rlhf.loss.DPOLoss", "beta": 0.05, "label_smoothing": 0}
    else:
        dataset = {"_component_": "torchtune.datasets.text_completion_dataset", "source": "json",
                   "data_files": os.path.join(assets, "text.json"), "column": "text", "split": "train", "packed": False}  # fmt: skip
        loss = {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"}
    return {
        "output_dir": None,
        "model": model,
        "tokenizer": {"_component_": "torchtune.models.llama2.llama2_tokenizer",
                      "path": os.path.join(assets, "tokenizer.model"), "max_seq_len": 64},  # fmt: skip
        "checkpointer": _checkpointer(assets),
        "resume_from_checkpoint": False,
        "dataset": dataset,
        "seed": 0,
        "shuffle": True,
        "batch_size": 4,
        "optimizer": {"_component_": "torch.optim.AdamW", "fused": False, "weight_decay": 0.01, "lr": 3e-3},
        "lr_scheduler": {"_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
                         "num_warmup_steps": 2},  # fmt: skip
        "loss": loss,
        "epochs": 1,
        "max_steps_per_epoch": STEPS,
        "gradient_accumulation_steps": 2,
        "clip_grad_norm": 1.0,
        "compile": False,
        "metric_logger": {"_component_": "torchtune.training.metric_logging.DiskLogger", "log_dir": "${output_dir}/logs"},
        "log_every_n_steps": 1,
        "log_peak_memory_stats": False,
        "device": "cpu",
        "dtype": "bf16",
        "enable_activation_checkpointing": True,
        "enable_activation_offloading": False,
        "profiler": {"_component_": "torchtune.training.setup_torch_profiler", "enabled": False},
        **({"fsdp": {"cpu_offload": False}, "save_adapter_weights_only": False} if lora else {}),
    }


def _full(assets: str, preference: bool = False) -> dict:
    cfg = _config(assets, lora=False, preference=preference)
    cfg.update(custom_sharded_layers=["tok_embeddings", "output"], fsdp_cpu_offload=False, optimizer_in_bwd=False)
    return cfg


def _qlora(assets: str) -> dict:
    cfg = _config(assets, lora=True)
    cfg["model"]["quantize_base"] = True
    return cfg


QAT = {"quantizer": {"_component_": "torchtune.training.quantization.Int8DynActInt4WeightQATQuantizer", "groupsize": 32},
       "fake_quant_after_n_steps": 1}


# name: (recipe, ranks, config builder, command-line overrides)
RUNS = {
    "qlora": ("lora_finetune_distributed", 2, _qlora, []),
    "full_optimizer_in_bwd": ("full_finetune_distributed", 2, _full,
                              ["optimizer_in_bwd=True", "clip_grad_norm=null", "gradient_accumulation_steps=1"]),  # fmt: skip
    "qlora_cpu_offload": ("lora_finetune_distributed", 2, _qlora, ["fsdp.cpu_offload=True"]),
    "qlora_compile": ("lora_finetune_distributed", 2, _qlora, ["compile=True"]),
    "dora": ("lora_finetune_distributed", 2, lambda a: _config(a, lora=True), ["model.use_dora=True"]),
    "full": ("full_finetune_distributed", 2, _full, []),
    # torch's clip_grad_norm_ cannot stack the norms of the 1-D and 2-D meshes' parameters
    # (with torch FSDP2 as with fsdp_native), so no clipping with tensor parallelism
    "full_tp_2x2": ("full_finetune_distributed", 4, _full,
                    ["tensor_parallel_dim=2", "tensor_parallel_plan._component_=torchtune.models.llama3.base_llama_tp_plan",
                     "clip_grad_norm=null"]),  # fmt: skip
    "knowledge_distillation": ("knowledge_distillation_distributed", 2, lambda a: {
        **_config(a, lora=True),
        "teacher_model": {"_component_": "torchtune.models.llama2.llama2", **ARCH},
        "teacher_checkpointer": _checkpointer(a),
        "kd_loss": {"_component_": "torchtune.modules.loss.ForwardKLWithChunkedOutputLoss"},
        "kd_ratio": 0.5,
    }, []),
    # quantization-aware training: torchao's int8-activation / int4-weight fake quantization
    # swapped into the Linears before sharding (groups of 32 along the 256-wide rows), switched
    # on after the first step. (qat_lora_finetune_distributed stops before any sharding, with
    # either implementation: torchtune 0.6.1's QATLoRALinear asserts on torchao 0.15's
    # FakeQuantizeConfig.)
    "qat": ("qat_distributed", 2, lambda a: {**_full(a), **QAT}, []),
    "lora_dpo": ("lora_dpo_distributed", 2, lambda a: _config(a, lora=True, preference=True), []),
    "full_dpo": ("full_dpo_distributed", 2, lambda a: {**_full(a, preference=True), "ref_checkpointer": _checkpointer(a)}, []),
}
IN_MAKE_TEST = ["qlora", "full_optimizer_in_bwd"]


def _assets(root: str) -> str:
    out = os.path.join(root, "assets")
    if not os.path.isdir(os.path.join(out, "ckpt")):
        run_in_site(SITE, [os.path.join(HERE, "torchtune_recipe.py"), "--make-assets", out], "torchtune's assets", timeout=300)
    return out


def _run(root: str, name: str, impl: str) -> dict:
    """One recipe run; its logged metrics, fully_shard call count and saved tensors."""
    recipe, ranks, build, overrides = RUNS[name]
    assets = _assets(root)
    out = os.path.join(root, f"{name}-{impl}")
    cfg_path = os.path.join(root, f"{name}.yaml")
    with open(cfg_path, "w") as f:
        yaml.safe_dump(build(assets), f)
    args = torchrun(ranks, os.path.join(HERE, "torchtune_recipe.py"), recipe, "--config", cfg_path, f"output_dir={out}", *overrides)
    log = run_in_site(SITE, args, f"{name} with {impl}", FSDP_IMPL=impl)
    (metrics,) = glob.glob(os.path.join(out, "logs", "*.txt"))
    with open(metrics) as f:  # "Step 1 | loss:... lr:... tokens_per_second_per_gpu:... grad_norm:..."
        steps = [[w for w in line.split() if not w.startswith("tokens_per_second")] for line in f if line.strip()]
    calls = [line for line in log.splitlines() if line.startswith(f"fully_shard calls ({impl}):")]
    tensors = {}
    for path in sorted(glob.glob(os.path.join(out, "epoch_*", "*.safetensors"))):
        for key, t in load_file(path).items():
            tensors[f"{os.path.relpath(path, out)}:{key}"] = t
    return {"steps": steps, "calls": calls[0].split(": ")[1] if calls else None, "tensors": tensors}


def check(root: str, name: str) -> None:
    ref, got = _run(root, name, "torch"), _run(root, name, "fsdp_native")
    assert ref["steps"], f"{name}: torchtune logged no step"
    assert got["steps"] == ref["steps"], f"{name}: torchtune's log differs:\n{ref['steps']}\n{got['steps']}"
    assert got["calls"] is not None and int(got["calls"]) > 0 and got["calls"] == ref["calls"], (got["calls"], ref["calls"])
    assert ref["tensors"] and got["tensors"].keys() == ref["tensors"].keys(), sorted(set(got["tensors"]) ^ set(ref["tensors"]))
    differ = [k for k, t in ref["tensors"].items() if not torch.equal(t, got["tensors"][k])]
    assert not differ, f"{name}: saved tensors differ from torch FSDP2's: {differ[:6]}"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("torchtune"))


@pytest.mark.parametrize("name", IN_MAKE_TEST)
def test_torchtune_recipe_matches_torch_fsdp2(root, name):
    check(root, name)


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory(prefix="torchtune_") as tmp:
        for run in sys.argv[1:] or RUNS:
            check(tmp, run)
            print(f"{run}: bit for bit torch FSDP2's", flush=True)
