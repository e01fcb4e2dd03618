"""PEFT LoRA fine-tuning through the Transformers Trainer with FSDP2 (the fsdp_config of the
Hugging Face FSDP2 docs), a tiny Llama from a LlamaConfig (no Hub) on 2 CPU ranks:

* fsdp_native against torch FSDP2 in the same spawn, fp32 and bf16: bitwise equal losses and
  parameters; the frozen base weights are unchanged and every adapter trained; the adapter
  files that ``Trainer.save_model`` writes are bitwise equal;
* QLoRA-style with fsdp_native's NF4 all-gather for the frozen base weights
  (``use_with_accelerate(all_gather=QuantizedAllGather("nf4"))``): the decoder layers gather NF4
  for the base weights and full precision for the adapters and norms, training follows the
  unquantized run's losses, and the saved adapters are the trained full-precision ones;
* FSDP-QLoRA with bitsandbytes (the bitsandbytes and PEFT docs' recipe): the base model loaded
  from a checkpoint with ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_storage=...)``,
  its ``Params4bit`` weights packed NF4 bytes. With a floating storage dtype they are sharded
  like any parameter (their packed bytes gathered, bitsandbytes dequantizes in the forward);
  with the default uint8 storage Accelerate leaves them out of FSDP (``ignored_params``).
  Bitwise torch FSDP2: losses, every parameter's bytes and layout, the saved adapters; the
  packed base weights never change and every adapter trains.
"""
from __future__ import annotations

import os

import pytest

from dist_utils import ctx, run_distributed, run_grid
from test_hf_common import HF_PRELOAD, as_bits, assert_same, check_adapters_trained, set_launcher_env

pytest.importorskip("peft", reason="peft is a test dependency (make test installs it)")


def _adapters(path: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "adapter_model.safetensors"))


def _initial_params(dtype: str | None = None) -> dict:
    import torch

    from test_hf_trainer import lora_llama

    model = lora_llama()
    if dtype is not None:
        model.to(getattr(torch, dtype))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _check_trained(what: str, params: dict, init: dict) -> None:
    check_adapters_trained(what, params, init, adapters=2 * 4 * 2)  # A and B of 4 projections in 2 layers


def _parity(bf16: bool, model_dtype: str | None = None) -> None:
    import torch.distributed as dist

    from test_hf_trainer import trainer_run

    dirs = {impl: os.path.join(ctx().tmpdir, f"peft-{impl}-{bf16}") for impl in ("torch", "native")}
    ref = trainer_run("torch", lora=True, bf16=bf16, save_dir=dirs["torch"], model_dtype=model_dtype)
    got = trainer_run("native", lora=True, bf16=bf16, save_dir=dirs["native"], model_dtype=model_dtype)
    assert_same("losses", got[0], ref[0])
    assert_same("parameters", got[1], ref[1])
    _check_trained("fsdp_native", got[1], _initial_params(model_dtype))
    dist.barrier()
    saved = {impl: _adapters(d) for impl, d in dirs.items()}
    assert saved["native"] and all("lora_" in k for k in saved["native"]), sorted(saved["native"])
    assert_same("saved adapters", saved["native"], saved["torch"])


def _nf4() -> None:
    import torch.distributed as dist

    import fsdp_native
    from test_hf_accelerate import _gathers
    from test_hf_trainer import trainer_run

    batch = __import__("test_hf_common").token_batches(1, bsz=2)[0]
    seen = {}
    plain = trainer_run("native", lora=True, on_trained=lambda t: seen.update(plain=_gathers(t.model, batch)))
    save_dir = os.path.join(ctx().tmpdir, "peft-nf4")
    quant = trainer_run(
        "native",
        lora=True,
        all_gather=fsdp_native.QuantizedAllGather("nf4", min_numel=256),
        save_dir=save_dir,
        on_trained=lambda t: seen.update(nf4=_gathers(t.model, batch)),
    )
    layers = {u: v for u, v in seen["nf4"].items() if ".layers." in u}
    assert len(layers) == 2 and all(f == "nf4" for f, _ in layers.values()), seen["nf4"]
    for u, (_, nbytes) in layers.items():
        # fp32 base weights as NF4 (about 0.14x), adapters and norms in fp32: 0.25x measured.
        assert nbytes <= 0.30 * seen["plain"][u][1], (u, nbytes, seen["plain"][u][1])
    worst = max(abs(a.item() - b.item()) for a, b in zip(quant[0], plain[0]))
    assert worst < 0.05, f"nf4: losses differ from the unquantized run's by {worst:.4f}: {quant[0]} vs {plain[0]}"
    _check_trained("fsdp_native with NF4 all-gather", quant[1], _initial_params())
    dist.barrier()
    saved = _adapters(save_dir)
    want = {k: v for k, v in quant[1].items() if "lora_" in k}
    assert len(saved) == len(want), (sorted(saved), sorted(want))
    for k, v in saved.items():  # PEFT drops the adapter name from the keys it saves
        match = [w for n, w in want.items() if n.replace(".default", "") == k]
        assert len(match) == 1, (k, sorted(want))
        assert_same(f"saved adapter {k!r}", v, match[0])


def _bnb_model(storage: str):
    """A tiny Llama checkpoint loaded in 4 bits with bitsandbytes, with LoRA adapters."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from test_hf_common import bnb_4bit_config, tiny_llama_dir

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir(), quantization_config=bnb_4bit_config(storage), dtype=torch.bfloat16)
    torch.manual_seed(0)  # the adapters' initialisation
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"])
    return get_peft_model(model, cfg)


def _bnb_qlora(storage: str, **cfg) -> None:
    import torch.distributed as dist
    from bitsandbytes.nn import Params4bit
    from torch.distributed.tensor import DTensor

    from test_hf_trainer import trainer_run

    def plain(n: str) -> str:  # activation checkpointing wraps each decoder layer
        return n.replace("._checkpoint_wrapped_module", "")

    def layout(trainer) -> dict:
        return {
            plain(n): (isinstance(p, DTensor), tuple((p.to_local() if isinstance(p, DTensor) else p).shape), p.dtype)
            for n, p in trainer.model.named_parameters()
        }

    def raw(params: dict) -> dict:
        return {plain(n): v for n, v in as_bits(params).items()}

    init = _bnb_model(storage)
    packed = [n for n, p in init.named_parameters() if isinstance(p, Params4bit)]
    assert len(packed) == 7 * 2, packed  # every projection of the 2 decoder layers
    init = raw({n: p.detach().clone() for n, p in init.named_parameters()})
    seen, dirs = {}, {}
    out = {}
    for impl in ("torch", "native"):
        dirs[impl] = os.path.join(ctx().tmpdir, f"bnb-{storage}-{impl}")
        out[impl] = trainer_run(
            impl, lora=True, bf16=True, model_fn=lambda: _bnb_model(storage), save_dir=dirs[impl],
            on_trained=lambda t, impl=impl: seen.__setitem__(impl, layout(t)), **cfg,
        )
    assert_same("losses", out["native"][0], out["torch"][0])
    assert_same("parameter bytes", raw(out["native"][1]), raw(out["torch"][1]))
    assert seen["native"] == seen["torch"], {n: (seen["native"][n], v) for n, v in seen["torch"].items() if seen["native"][n] != v}
    sharded = sorted(n for n in packed if seen["native"][n][0])
    # a floating storage: the packed weights are sharded; uint8: Accelerate keeps them out
    assert sharded == (sorted(packed) if storage != "uint8" else []), (storage, sharded)
    _check_trained(f"fsdp_native (bitsandbytes, {storage} storage)", raw(out["native"][1]), init)
    dist.barrier()
    assert_same("saved adapters", _adapters(dirs["native"]), _adapters(dirs["torch"]))


def _grid() -> None:
    set_launcher_env()
    run_grid([dict(bf16=False), dict(bf16=True), dict(bf16=True, model_dtype="bfloat16")], _parity, name="peft")
    run_grid([{}], lambda: _nf4(), name="peft nf4")
    bnb = [dict(storage="bfloat16"), dict(storage="bfloat16", activation_checkpointing=True), dict(storage="uint8")]
    run_grid(bnb, _bnb_qlora, name="peft bitsandbytes")


def test_peft_lora_trainer_ws2():
    run_distributed(_grid, 2, timeout=400, preload=HF_PRELOAD)
