"""Shared pieces of the Hugging Face tests (tiny Llama, Accelerate set-up), and the
single-process tests of fsdp_native.integrations: pinned versions, hook-point detection and
its error text, restore()."""
from __future__ import annotations

import os

import pytest

# Never reach the Hub: every model here is built from a LlamaConfig.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

# The versions the HF tests were written and run against (the Makefile installs these).
PINNED = {"accelerate": "1.16.0", "transformers": "5.25.0"}

VOCAB = 96
SEQ = 16
# What the multi-process Hugging Face tests' workers inherit imported from the fork server
# (dist_utils.run_distributed(preload=...)): transformers' Trainer and Llama, Accelerate.
# Imported by each rank instead, they took about 9 s of CPU a rank.
HF_PRELOAD = ("transformers.trainer", "transformers.models.llama.modeling_llama", "accelerate")


def tiny_llama_config(**kw):
    from transformers import LlamaConfig

    args = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="eager",
    )
    args.update(kw)
    return LlamaConfig(**args)


def tiny_llama(seed: int = 0, **kw):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**kw))
    return model


def tiny_llama_dir() -> str:
    """tiny_llama(0) saved once in the run's directory, for flows that load a model from a path."""
    import torch.distributed as dist

    from dist_utils import ctx

    d = os.path.join(ctx().tmpdir, "tiny-llama")
    if dist.get_rank() == 0 and not os.path.isdir(d):
        tiny_llama(0).save_pretrained(d)
    dist.barrier()
    return d


def bnb_4bit_config(storage: str = "bfloat16"):
    """FSDP-QLoRA's bitsandbytes config (its docs'): NF4, bf16 compute, ``storage`` the dtype
    that holds the packed bytes (a floating one lets FSDP shard them)."""
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_quant_storage=getattr(torch, storage),
    )


def as_bits(params: dict) -> dict:
    """bf16 tensors viewed as int16, to compare packed 4-bit bytes (a bf16 NaN pattern is data)."""
    import torch

    return {n: v.view(torch.int16) if v.dtype == torch.bfloat16 else v for n, v in params.items()}


def check_adapters_trained(what: str, params: dict, init: dict, adapters: int) -> None:
    """LoRA trained, not a no-op: of the full parameters, exactly the ``adapters`` "lora_" ones
    differ from their ``init`` values."""
    import torch

    assert params.keys() == init.keys(), sorted(set(params) ^ set(init))
    lora = [n for n in init if "lora_" in n]
    assert len(lora) == adapters, lora
    for n, v in init.items():
        same = torch.equal(params[n].to(v.dtype), v)
        assert same != (n in lora), f"{what}: {n!r} {'did not change' if same else 'changed'} (frozen: {n not in lora})"


def token_batches(n: int, bsz: int, seed: int = 1234):
    """n batches of (bsz, SEQ) token ids, identical on every rank (each rank slices its part)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (bsz, SEQ), generator=g) for _ in range(n)]


def train_steps(model, steps: int = 3, lr: float = 1e-2):
    """``steps`` AdamW steps of a causal LM on token_batches (each rank its 2 rows); returns
    (losses, full parameters)."""
    import torch
    import torch.distributed as dist

    from dist_utils import full_params

    rank, world = dist.get_rank(), dist.get_world_size()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for batch in token_batches(steps, bsz=2 * world):
        x = batch[2 * rank : 2 * rank + 2]
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().float().clone())
    return losses, full_params(model)


def set_launcher_env():
    """What torchrun sets, for Accelerate's PartialState (the gloo group already exists)."""
    from dist_utils import ctx

    c = ctx()
    os.environ.update(
        RANK=str(c.rank),
        WORLD_SIZE=str(c.world_size),
        LOCAL_RANK=str(c.rank),
        LOCAL_WORLD_SIZE=str(c.world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
        HF_HUB_OFFLINE="1",
    )


def reset_accelerate():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    os.environ.pop("ACCELERATE_USE_FSDP", None)
    os.environ.pop("FSDP_CPU_RAM_EFFICIENT_LOADING", None)


def impl_handle(impl: str, all_gather=None):
    """Accelerate on CPU FSDP with torch's fully_shard ('torch') or fsdp_native's ('native',
    with an optional quantized all-gather)."""
    import fsdp_native.integrations as fi

    if impl == "torch":
        assert all_gather is None, "torch FSDP2 has no quantized all-gather"
        return fi.enable_accelerate_cpu_fsdp()
    assert impl == "native", impl
    return fi.use_with_accelerate(cpu=True, all_gather=all_gather)


def check_impl(model, impl: str):
    """Every FSDP unit of ``model`` belongs to the implementation the run asked for."""
    import fsdp_native
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    assert units, "no FSDP unit: Accelerate did not shard the model"
    native = [isinstance(m, fsdp_native.FSDPModule) for m in units]
    if impl == "native":
        assert all(native), f"{native.count(False)} of {len(units)} units are torch's, expected fsdp_native's"
    else:
        assert not any(native), f"{native.count(True)} of {len(units)} units are fsdp_native's, expected torch's"


def assert_same(what: str, a, b):
    """Bitwise equality of tensors, lists of tensors or dicts of tensors."""
    import torch

    if isinstance(a, dict):
        assert a.keys() == b.keys(), f"{what}: keys differ: {sorted(a.keys() ^ b.keys())}"
        bad = [k for k in a if not torch.equal(a[k], b[k])]
        if bad:
            k = bad[0]
            d = (a[k].float() - b[k].float()).abs().max().item()
            raise AssertionError(f"{what}: {len(bad)} of {len(a)} differ, e.g. {k} (max abs diff {d:.3e})")
        return
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{what}: {len(a)} vs {len(b)} entries"
        bad = [i for i, (x, y) in enumerate(zip(a, b)) if not torch.equal(torch.as_tensor(x), torch.as_tensor(y))]
        show = lambda xs: [f"{torch.as_tensor(xs[i]).double().flatten()[0].item():.10g}" for i in bad]  # noqa: E731
        assert not bad, f"{what}: entries {bad} differ: {show(a)} vs {show(b)}"
        return
    assert torch.equal(a, b), f"{what}: differ: {a} vs {b}"


# ---------------------------------------------------------------------------
# Single-process tests of fsdp_native.integrations
# ---------------------------------------------------------------------------
def test_installed_versions_are_the_tested_ones():
    from importlib.metadata import version

    import fsdp_native.integrations as fi

    for pkg, v in PINNED.items():
        assert version(pkg) == v, f"{pkg} {version(pkg)} installed; the HF tests are pinned to {v} (Makefile)"
        assert v in fi.TESTED_VERSIONS[pkg], f"{pkg} {v} missing from fsdp_native.integrations.TESTED_VERSIONS"


def test_patch_and_restore():
    import accelerate.state as acc_state
    import torch.distributed.fsdp as tfsdp

    import fsdp_native
    import fsdp_native.integrations as fi

    torch_fs, init = tfsdp.fully_shard, acc_state.AcceleratorState.__init__
    env = os.environ.get("ACCELERATE_USE_CPU")
    with fi.use_with_accelerate(cpu=True) as h:
        assert h.active
        assert tfsdp.fully_shard is fsdp_native.fully_shard
        assert acc_state.AcceleratorState.__init__ is not init
        assert os.environ["ACCELERATE_USE_CPU"] == "true"
        with pytest.raises(RuntimeError, match="already active"):
            fi.use_with_accelerate()
    assert not h.active
    assert tfsdp.fully_shard is torch_fs
    assert acc_state.AcceleratorState.__init__ is init
    assert os.environ.get("ACCELERATE_USE_CPU") == env
    h.restore()  # twice is harmless
    with pytest.warns(UserWarning, match="cpu=True"):
        h = fi.use_with_accelerate()
    assert tfsdp.fully_shard is fsdp_native.fully_shard and acc_state.AcceleratorState.__init__ is init
    h.restore()
    with fi.enable_accelerate_cpu_fsdp():
        assert tfsdp.fully_shard is torch_fs and acc_state.AcceleratorState.__init__ is not init
    assert acc_state.AcceleratorState.__init__ is init
    with pytest.raises(TypeError, match="argument 'cpu'"):
        fi.use_with_accelerate(cpu="yes")
    with pytest.raises(TypeError) as e:
        fi.use_with_accelerate(cpu=True, all_gather="fp8_rowwise")
    assert str(e.value) == (
        "use_with_accelerate: argument 'all_gather' is a str, expected a fsdp_native.QuantizedAllGather or None"
    ), str(e.value)
    assert not fi._ACTIVE and tfsdp.fully_shard is torch_fs
    # With a quantized all-gather the patched fully_shard wraps fsdp_native's, and restore undoes it.
    with fi.use_with_accelerate(cpu=True, all_gather=fsdp_native.QuantizedAllGather("nf4")) as h:
        assert tfsdp.fully_shard is not fsdp_native.fully_shard and tfsdp.fully_shard.__wrapped__ is fsdp_native.fully_shard
        assert "all_gather=QuantizedAllGather(" in repr(h), repr(h)
    assert tfsdp.fully_shard is torch_fs


def test_size_based_policy_leaves_out_containers():
    """Accelerate's SIZE_BASED_WRAP policy, patched in both integrations: a layer list
    (nn.ModuleList) is never chosen, a ModuleList subclass with its own forward and every other
    module as Accelerate chooses them, except (the tiny Llama) the base model, which holds the
    embedding and final norm Accelerate carves out; restore puts Accelerate's function back."""
    import accelerate.utils.fsdp_utils as fu
    import torch.nn as nn
    from accelerate.utils import FullyShardedDataParallelPlugin

    import fsdp_native.integrations as fi

    class Stack(nn.ModuleList):
        def forward(self, x):
            return x

    model = nn.Sequential(nn.Linear(20, 20), nn.ModuleList([nn.Linear(20, 20), nn.Linear(20, 20)]), Stack([nn.Linear(20, 20)]))
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=100)
    original = fu.fsdp2_prepare_auto_wrap_policy
    chosen = lambda: [n for n, m in model.named_modules() if fu.fsdp2_prepare_auto_wrap_policy(plugin, model)(m)]  # noqa: E731
    assert chosen() == ["", "0", "1", "1.0", "1.1", "2", "2.0"], chosen()  # Accelerate's own, the list "1" included
    llama = tiny_llama()
    plugin_2k = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=2000)
    in_llama = lambda: [n for n, m in llama.named_modules() if fu.fsdp2_prepare_auto_wrap_policy(plugin_2k, llama)(m) and "layers.1" not in n]  # noqa: E731
    everything = ["", "model", "model.embed_tokens", "model.layers", "model.layers.0", "model.layers.0.self_attn",
                  "model.layers.0.mlp", "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj", "lm_head"]
    assert in_llama() == everything, in_llama()
    for install in (lambda: fi.use_with_accelerate(cpu=True), fi.enable_accelerate_cpu_fsdp):
        with install():
            assert fu.fsdp2_prepare_auto_wrap_policy.__wrapped__ is original
            assert chosen() == ["", "0", "1.0", "1.1", "2", "2.0"], chosen()
            assert in_llama() == [n for n in everything if n not in ("model", "model.layers")], in_llama()
        assert fu.fsdp2_prepare_auto_wrap_policy is original


def test_unknown_hook_points_fail_clearly(monkeypatch):
    """An Accelerate whose fsdp2_prepare_model binds fully_shard at import (so a patch of
    torch.distributed.fsdp would not reach it) is refused, naming the versions."""
    import accelerate.utils.fsdp_utils as fu
    import torch.distributed.fsdp as tfsdp

    import fsdp_native.integrations as fi

    def fsdp2_prepare_model(accelerator, model):  # the shape of a future Accelerate
        return fully_shard(model)  # noqa: F821 - a module global there

    monkeypatch.setattr(fu, "fsdp2_prepare_model", fsdp2_prepare_model)
    monkeypatch.setattr(fu, "fully_shard", tfsdp.fully_shard, raising=False)
    with pytest.raises(fi.IntegrationError) as e:
        fi.use_with_accelerate(cpu=True)
    msg = str(e.value)
    assert f"accelerate {PINNED['accelerate']}" in msg and f"transformers {PINNED['transformers']}" in msg
    assert "tested with accelerate 1.15.0 / 1.16.0, transformers 5.24.0 / 5.25.0" in msg
    assert "fsdp2_prepare_model does not import fully_shard from torch.distributed.fsdp" in msg
    assert "accelerate.utils.fsdp_utils bind(s) torch's fully_shard at import time" in msg
    assert tfsdp.fully_shard is not __import__("fsdp_native").fully_shard  # nothing patched
    assert not fi._ACTIVE

    # The CPU hook: an AcceleratorState without the 'cpu' parameter.
    monkeypatch.undo()
    import accelerate.state as st

    def __init__(self, mixed_precision=None, fsdp_plugin=None, **kwargs):
        pass

    monkeypatch.setattr(st.AcceleratorState, "__init__", __init__)
    with pytest.raises(fi.IntegrationError, match=r"AcceleratorState.__init__ has no parameter 'cpu'"):
        fi.use_with_accelerate(cpu=True)
    with pytest.warns(UserWarning):
        fi.use_with_accelerate(cpu=False).restore()  # cpu=False needs no AcceleratorState hook


def test_transformers_hook_points_checked(monkeypatch):
    import transformers.training_args as ta

    import fsdp_native.integrations as fi

    def _setup_devices(self):  # reads no ACCELERATE_USE_CPU
        return "cpu"

    monkeypatch.setattr(ta.TrainingArguments, "_setup_devices", property(_setup_devices))
    with pytest.raises(fi.IntegrationError, match="TrainingArguments._setup_devices does not read ACCELERATE_USE_CPU"):
        fi.use_with_accelerate(cpu=True)
    with pytest.warns(UserWarning):
        fi.use_with_accelerate(cpu=False).restore()  # the Trainer needs that hook only for cpu=True


def test_transformers4_trainer_fsdp_from_the_environment(monkeypatch):
    """Transformers 4 (4.57, what GPU images ship) makes no FSDP plugin in the Trainer: its
    TrainingArguments set ACCELERATE_USE_FSDP and FSDP_* variables, from which Accelerator makes
    one, and Accelerate's FSDP2 path then calls the patched fully_shard. Accepted; a Trainer
    that neither makes a plugin nor sets the variable is refused."""
    import os

    import transformers.trainer as tr
    import transformers.training_args as ta

    import fsdp_native.integrations as fi

    def create_accelerator_and_postprocess(self):  # the shape of Transformers 4.57's
        self.accelerator = Accelerator(deepspeed_plugin=self.args.deepspeed_plugin)  # noqa: F821

    def __post_init__(self):
        if self.fsdp:
            os.environ["ACCELERATE_USE_FSDP"] = "true"

    monkeypatch.setattr(tr.Trainer, "create_accelerator_and_postprocess", create_accelerator_and_postprocess)
    monkeypatch.setattr(ta.TrainingArguments, "__post_init__", __post_init__)
    with pytest.warns(UserWarning):  # no CUDA here
        fi.use_with_accelerate(cpu=False).restore()

    def __post_init__(self):  # sets nothing
        pass

    monkeypatch.setattr(ta.TrainingArguments, "__post_init__", __post_init__)
    with pytest.raises(fi.IntegrationError) as e:
        fi.use_with_accelerate(cpu=False)
    assert (
        "transformers: Trainer.create_accelerator_and_postprocess does not use FullyShardedDataParallelPlugin, nor "
        "does TrainingArguments.__post_init__ set ACCELERATE_USE_FSDP"
    ) in str(e.value), str(e.value)
    assert not fi._ACTIVE


def test_transformers_native_fsdp_hook_point(monkeypatch):
    """Transformers' own FSDP2 path (from_pretrained(distributed_config=...)) calls the module
    global transformers.distributed.fsdp.fully_shard: patched and restored with the rest, and
    a Transformers whose apply function does not call it is refused."""
    import torch.distributed.fsdp as tfsdp
    import transformers.distributed.fsdp as tf_fsdp

    import fsdp_native
    import fsdp_native.integrations as fi

    torch_fs = tf_fsdp.fully_shard
    assert torch_fs is tfsdp.fully_shard
    with fi.use_with_accelerate(cpu=True):
        assert tf_fsdp.fully_shard is fsdp_native.fully_shard
    assert tf_fsdp.fully_shard is torch_fs
    with fi.enable_accelerate_cpu_fsdp():  # torch's fully_shard stays everywhere
        assert tf_fsdp.fully_shard is torch_fs

    def apply_fully_sharded_data_parallelism(model, mesh_manager, fsdp_plan, ep_plan):  # shards some other way
        return model

    monkeypatch.setattr(tf_fsdp, "apply_fully_sharded_data_parallelism", apply_fully_sharded_data_parallelism)
    with pytest.raises(fi.IntegrationError) as e:
        fi.use_with_accelerate(cpu=True)
    assert "transformers.distributed.fsdp.apply_fully_sharded_data_parallelism does not call the module's fully_shard" in str(e.value)
    assert tf_fsdp.fully_shard is torch_fs and not fi._ACTIVE


def _import_kernels_from_checkout(extra_path: str | None, hide_others: bool = False) -> list[str]:
    """`import kernels` in a fresh interpreter run from the repository root, whose folder
    `kernels/` (fsdp_native.kernels) is then on sys.path as '', ahead of every installed
    package; what it printed. ``hide_others``: first take off sys.path every other folder that
    holds a `kernels` (Hugging Face's is installed with transformers 5.25)."""
    import subprocess
    import sys

    import fsdp_native

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # Where this process took fsdp_native from: the checkout with `make test`'s editable
    # install, a build folder (PYTHONPATH) for the other torch versions' suites, whose
    # extension is built for their torch.
    lib = os.path.dirname(os.path.dirname(os.path.abspath(fsdp_native.__file__)))
    env = dict(os.environ)
    env.pop("PYTHONSAFEPATH", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, env.get("PYTHONPATH")) if p)
    code = f"""
import os, sys
assert sys.path[0] == ''
sys.path.insert(0, {lib!r})
import fsdp_native.kernels.quant as q
print(q.__name__)
if {hide_others}:
    keep = ('', {root!r})
    sys.path[:] = [p for p in sys.path if p in keep or not os.path.exists(os.path.join(p, 'kernels'))]
try:
    import kernels, kernels.sub
    print(kernels.__name__, kernels.WHO, kernels.sub.WHO)
except ImportError as e:
    print(type(e).__name__, e)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()


def test_checkout_root_does_not_hide_hugging_face_kernels(tmp_path):
    """Run from a source checkout, the top-level name `kernels` is still Hugging Face's
    package (transformers 5.25 requires and imports it): the checkout's `kernels/` folder
    once took the name, and `import transformers.trainer` failed ("cannot import name
    'CUDAProperties' from 'kernels'")."""
    pkg = tmp_path / "kernels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("WHO = 'the other package'\n")
    (pkg / "sub.py").write_text("WHO = 'its submodule'\n")
    out = _import_kernels_from_checkout(str(tmp_path))
    assert out == ["fsdp_native.kernels.quant", "kernels the other package its submodule"]


def test_checkout_root_without_other_kernels_package():
    """Without another package of that name, `import kernels` fails as it does outside the
    checkout (transformers then finds no hub kernels and goes on)."""
    out = _import_kernels_from_checkout(None, hide_others=True)
    assert out == ["fsdp_native.kernels.quant", "ModuleNotFoundError No module named 'kernels'"]
