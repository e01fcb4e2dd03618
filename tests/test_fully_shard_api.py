"""API surface of the implementation under test, compared with torch FSDP2.

In-process checks: exports, ``fully_shard``'s signature, the policy classes,
the public methods of ``FSDPModule``.  Spawned (world size 2): ``isinstance``
with torch's ``FSDPModule``, DTensor parameters with ``Shard(0)`` placement and
torch's local shards, ``unshard``/``reshard``, which parameters are registered
after forward for each ``reshard_after_forward``, ``set_requires_gradient_sync``,
torch's policy objects, ``register_fsdp_forward_method``, and the unsharded-memory
statistics (``unsharded_stats`` / ``reset_unsharded_peak``): with
``reshard_after_forward=True`` at most the root, the running unit and the
prefetched one are unsharded at a time.
"""
from __future__ import annotations

import dataclasses
import inspect
import os

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from torch.distributed.tensor import DTensor, Shard

from dist_utils import assert_close, full, load_impl, ref_impl, run_distributed, run_grid
from models import Cfg, Transformer, build_fsdp, lm_loss, make_batches, make_mesh

EXACT = dict(rtol=0, atol=0)


# ---------------------------------------------------------------------------
# In-process checks (no process group needed)
# ---------------------------------------------------------------------------
def test_public_exports():
    impl = load_impl()
    m = impl.module
    missing = [
        n
        for n in (
            "fully_shard",
            "FSDPModule",
            "MixedPrecisionPolicy",
            "CPUOffloadPolicy",
            "OffloadPolicy",
            "UnshardHandle",
            "register_fsdp_forward_method",
            "unsharded_stats",
            "reset_unsharded_peak",
        )
        if not hasattr(m, n)
    ]
    assert not missing, f"{impl.name} does not export {missing}"


def test_fully_shard_signature_matches_torch():
    impl = load_impl()
    ours = inspect.signature(impl.fully_shard).parameters
    theirs = inspect.signature(torch_fsdp.fully_shard).parameters
    assert list(ours)[0] == "module", f"first parameter is {list(ours)[0]!r}"
    missing = [n for n in theirs if n not in ours]
    assert not missing, f"{impl.name}.fully_shard lacks torch's parameters {missing}"
    for name, p in theirs.items():
        if name == "module":
            continue
        q = ours[name]
        assert q.kind == inspect.Parameter.KEYWORD_ONLY, f"{name} should be keyword-only, is {q.kind}"
        if p.default is None:
            assert q.default is None, f"default of {name}: {q.default!r}, torch: None"
    assert ours["mp_policy"].default == impl.MixedPrecisionPolicy(), "default mp_policy must be MixedPrecisionPolicy()"
    d = ours["offload_policy"].default
    assert isinstance(d, impl.OffloadPolicy) and not isinstance(d, impl.CPUOffloadPolicy), (
        f"default offload_policy must be OffloadPolicy() (no offload), got {d!r}"
    )


def test_policy_classes_match_torch():
    impl = load_impl()
    ours = {f.name: f.default for f in dataclasses.fields(impl.MixedPrecisionPolicy)}
    theirs = {f.name: f.default for f in dataclasses.fields(torch_fsdp.MixedPrecisionPolicy)}
    # torch >= 2.15's keyword-only field: fsdp_native has it on every torch (tests/test_mp_override.py)
    override = ours.pop("param_dtype_override_fn", "missing")
    assert impl.name != "fsdp_native" or override is None, "MixedPrecisionPolicy lacks param_dtype_override_fn=None"
    theirs.pop("param_dtype_override_fn", None)
    assert ours == theirs, f"MixedPrecisionPolicy fields {ours} != torch's {theirs}"
    p = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert p == impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    hash(p)  # frozen dataclass, usable as a dict key like torch's
    assert impl.CPUOffloadPolicy().pin_memory is True
    assert impl.CPUOffloadPolicy(pin_memory=False).pin_memory is False
    assert issubclass(impl.CPUOffloadPolicy, impl.OffloadPolicy)


def test_fsdp_module_has_torch_public_methods():
    impl = load_impl()
    theirs = [n for n in dir(torch_fsdp.FSDPModule) if not n.startswith("_")]
    missing = [n for n in theirs if not callable(getattr(impl.FSDPModule, n, None))]
    assert not missing, f"{impl.name}.FSDPModule lacks torch FSDPModule's public methods {missing}"


# ---------------------------------------------------------------------------
# Spawned checks
# ---------------------------------------------------------------------------
def _batch(cfg: Cfg):
    return make_batches(cfg.model_args, 1, cfg.local_bsz)[0]


def check_isinstance_and_return():
    impl = load_impl()
    cfg = Cfg()
    model = build_fsdp(impl, cfg, make_mesh(cfg))  # asserts fully_shard returns the module
    for mod, name in [(model, "root"), (model.layers[0], "layers.0"), (model.layers[1], "layers.1")]:
        assert isinstance(mod, torch_fsdp.FSDPModule), f"{name}: not an instance of torch.distributed.fsdp.FSDPModule"
        assert isinstance(mod, impl.FSDPModule), f"{name}: not an instance of {impl.name}.FSDPModule"
    assert isinstance(model, Transformer), "the sharded module must still be an instance of its class"
    assert not isinstance(model.norm, torch_fsdp.FSDPModule), "modules not passed to fully_shard must be unchanged"
    # The list form groups modules into one unit and returns the list.
    m2 = Transformer(cfg.model_args)
    out = impl.fully_shard([m2.norm, m2.output], mesh=make_mesh(cfg))
    assert isinstance(out, list) and out[0] is m2.norm and out[1] is m2.output, f"list form returned {out!r}"
    assert all(isinstance(m, torch_fsdp.FSDPModule) for m in out)


def check_parameters_are_dtensors(model: str):
    impl, timpl = load_impl(), ref_impl()
    cfg = Cfg(model=model)
    mesh = make_mesh(cfg)
    a, b = build_fsdp(impl, cfg, mesh), build_fsdp(timpl, cfg, mesh)
    torch.manual_seed(0)
    plain = Transformer(cfg.model_args)
    names_plain = [n for n, _ in plain.named_parameters()]
    assert [n for n, _ in a.named_parameters()] == names_plain, "named_parameters() FQNs/order changed"
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert isinstance(pa, torch.nn.Parameter), f"{n}: {type(pa).__name__} is not an nn.Parameter"
        assert isinstance(pa, DTensor), f"{n}: {type(pa).__name__}, expected a DTensor"
        assert tuple(pa.placements) == (Shard(0),), f"{n}: placements {pa.placements}, expected (Shard(0),)"
        assert pa.device_mesh == mesh, f"{n}: device_mesh differs from the one passed to fully_shard"
        assert pa.requires_grad == pb.requires_grad
        assert pa.shape == pb.shape, f"{n}: global shape {tuple(pa.shape)} vs torch {tuple(pb.shape)}"
        assert pa.to_local().shape == pb.to_local().shape, (
            f"{n}: local shape {tuple(pa.to_local().shape)} vs torch {tuple(pb.to_local().shape)}"
        )
        assert_close(f"{n} local shard", pa.to_local(), pb.to_local(), EXACT)


def check_unshard_reshard():
    impl = load_impl()
    cfg = Cfg(model="odd")
    model = build_fsdp(impl, cfg, make_mesh(cfg))
    torch.manual_seed(0)
    plain = dict(Transformer(cfg.model_args).named_parameters())
    layer = model.layers[0]
    assert layer.unshard() is None, "unshard() (sync) must return None"
    for n, p in layer.named_parameters():
        assert not isinstance(p, DTensor), f"layers.0.{n} still a DTensor after unshard()"
        assert_close(f"layers.0.{n} unsharded", p.detach(), plain[f"layers.0.{n}"].detach(), EXACT)
    for n, p in model.layers[1].named_parameters():
        assert isinstance(p, DTensor), f"unshard() is not recursive, but layers.1.{n} was unsharded"
    layer.reshard()
    for n, p in layer.named_parameters():
        assert isinstance(p, DTensor) and tuple(p.placements) == (Shard(0),), f"layers.0.{n} after reshard()"
    h = model.unshard(async_op=True)
    h.wait()
    assert not isinstance(model.tok_embeddings.weight, DTensor)
    model.reshard()
    assert isinstance(model.tok_embeddings.weight, DTensor)


def check_registered_params_after_forward(reshard):
    """Which parameters are registered after forward / backward, per reshard_after_forward."""
    impl = load_impl()
    cfg = Cfg(reshard=reshard)
    model = build_fsdp(impl, cfg, make_mesh(cfg))
    x, y = _batch(cfg)
    loss = lm_loss(model(x), y)
    root_sharded = reshard is True
    blocks_sharded = reshard is not False
    w = model.tok_embeddings.weight
    assert isinstance(w, DTensor) == root_sharded, (
        f"reshard_after_forward={reshard!r}: after forward the root's parameters should be "
        f"{'sharded' if root_sharded else 'unsharded (root defaults to False)'}, got {type(w).__name__}"
    )
    for i, layer in enumerate(model.layers):
        p = layer.attention.wq.weight
        assert isinstance(p, DTensor) == blocks_sharded, (
            f"reshard_after_forward={reshard!r}: layers.{i} params after forward: {type(p).__name__}"
        )
    loss.backward()
    for n, p in model.named_parameters():
        assert isinstance(p, DTensor), f"after backward {n} must be sharded again, got {type(p).__name__}"
        assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements, f"{n}.grad: {type(p.grad)}"
    # set_reshard_after_forward at runtime (here: root False -> True).
    model.set_reshard_after_forward(True)
    lm_loss(model(x), y).backward()
    model(x)
    assert isinstance(model.tok_embeddings.weight, DTensor), "set_reshard_after_forward(True) not applied to root"


def check_no_sync():
    impl = load_impl()
    cfg = Cfg()
    model = build_fsdp(impl, cfg, make_mesh(cfg))
    x, y = _batch(cfg)
    model.set_requires_gradient_sync(False)
    lm_loss(model(x), y).backward()
    for n, p in model.named_parameters():
        assert p.grad is None, f"{n}.grad is set although set_requires_gradient_sync(False)"
    model.set_requires_gradient_sync(True)
    lm_loss(model(x), y).backward()
    for n, p in model.named_parameters():
        assert isinstance(p.grad, DTensor), f"{n}.grad missing after the synchronising backward"


def check_torch_policy_objects():
    """fsdp_native accepts torch's MixedPrecisionPolicy / CPUOffloadPolicy (one-line migration),
    and offload_policy=None for no offload, as torch FSDP2 takes it (veRL passes
    ``offload_policy=None`` for the roles it does not offload)."""
    impl = load_impl()
    cfg = Cfg()
    mesh = make_mesh(cfg)
    torch.manual_seed(0)
    model = Transformer(cfg.model_args)
    mp = torch_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for layer in model.layers:
        impl.fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=torch_fsdp.CPUOffloadPolicy(pin_memory=False))
    impl.fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=None)
    if impl.name == "fsdp_native":
        assert model._fsdp_native_unit.offload is None and model.layers[0]._fsdp_native_unit.offload is not None
    x, y = _batch(cfg)
    out = model(x)
    assert out.dtype == torch.bfloat16, f"torch MixedPrecisionPolicy(param_dtype=bf16) ignored: output {out.dtype}"
    lm_loss(out, y).backward()


def check_register_fsdp_forward_method():
    impl = load_impl()
    cfg = Cfg()
    model = build_fsdp(impl, cfg, make_mesh(cfg))
    torch.manual_seed(0)
    plain = Transformer(cfg.model_args)
    impl.module.register_fsdp_forward_method(model.layers[0], "_forward")
    h = torch.randn(2, cfg.model_args.max_seq_len, cfg.model_args.dim)
    out = model.layers[0]._forward(h)  # all-gathers like forward
    assert_close("layers.0._forward via register_fsdp_forward_method", out, plain.layers[0]._forward(h), FP_TOL)


FP_TOL = dict(rtol=1e-5, atol=1e-6)


def _unit_numel(module, skip_units=True) -> int:
    """Numel of the parameters a unit owns (not those of units below it)."""
    seen, total = set(), 0

    def visit(m, top):
        nonlocal total
        if not top and isinstance(m, torch_fsdp.FSDPModule):
            return
        for p in m.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
        for c in m.children():
            visit(c, False)

    visit(module, True)
    return total


def check_unsharded_memory(reshard, prefetch=False, ac=False, mp=None, n_layers=4):
    impl = load_impl()
    assert impl.unsharded_stats is not None and impl.reset_unsharded_peak is not None, (
        f"{impl.name} lacks unsharded_stats / reset_unsharded_peak"
    )
    cfg = Cfg(n_layers=n_layers, reshard=reshard, prefetch=prefetch, ac=ac, mp=mp)
    model = build_fsdp(impl, cfg, make_mesh(cfg))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    itemsize = 2 if mp else 4
    stats = impl.unsharded_stats(model)
    expected_units = [""] + [f"layers.{i}" for i in range(n_layers)]
    assert sorted(stats.units) == sorted(expected_units), f"units {sorted(stats.units)} != {expected_units}"
    mods = dict(model.named_modules())
    unit_bytes = {}
    for fqn in expected_units:
        u = stats.units[fqn]
        want = _unit_numel(mods[fqn]) * itemsize
        assert u.unsharded_bytes == want, f"unit {fqn!r}: unsharded_bytes {u.unsharded_bytes}, expected {want}"
        unit_bytes[fqn] = want
        assert u.current_bytes == 0, f"unit {fqn!r} holds {u.current_bytes} unsharded bytes right after init"
    assert stats.current_bytes == 0
    root = unit_bytes[""]
    blocks = sorted((unit_bytes[f] for f in expected_units[1:]), reverse=True)
    total = sum(unit_bytes.values())

    x, y = _batch(cfg)
    for step in range(2):
        impl.reset_unsharded_peak(model)
        s0 = impl.unsharded_stats(model)
        assert s0.peak_bytes == s0.current_bytes == 0, f"step {step}: after reset peak={s0.peak_bytes}"
        loss = lm_loss(model(x), y)
        s = impl.unsharded_stats(model)
        # Every unit with reshard_after_forward=True has freed its unsharded parameters, the
        # forward's last included (as torch does); None keeps the root's.
        after_fwd = {True: 0, None: root, False: total}[reshard]
        assert s.current_bytes == after_fwd, (
            f"reshard_after_forward={reshard!r}: {s.current_bytes} bytes unsharded after forward, expected "
            f"{after_fwd} (root {root}, total {total})"
        )
        loss.backward()
        s = impl.unsharded_stats(model)
        assert s.current_bytes == 0, f"{s.current_bytes} bytes still unsharded after backward: {s.units}"
        if reshard is False:
            assert s.peak_bytes == total, f"peak {s.peak_bytes} != all units {total} with reshard False"
        else:
            bound = root + blocks[0] + blocks[1]
            assert s.peak_bytes <= bound, (
                f"peak unsharded bytes {s.peak_bytes} > root + two largest blocks = {bound} "
                f"(root {root}, block {blocks[0]}; config reshard={reshard!r}, prefetch={prefetch}, ac={ac}, mp={mp})"
            )
            assert s.peak_bytes >= root + blocks[-1], (
                f"peak {s.peak_bytes} < root + one block {root + blocks[-1]}: accounting misses unshards"
            )
        for fqn, u in s.units.items():
            assert u.peak_bytes == u.unsharded_bytes, f"unit {fqn!r}: peak {u.peak_bytes} != {u.unsharded_bytes}"
            assert u.current_bytes == 0
        opt.step()
        opt.zero_grad()
        assert impl.unsharded_stats(model).current_bytes == 0


def check_modified_between_forward_and_backward():
    """The last unit of the forward is gathered again for its backward; writing its sharded
    parameters in between must still be seen by the backward, as with torch (which re-gathers)."""
    impl, timpl = load_impl(), ref_impl()
    cfg = Cfg(reshard=True)
    mesh = make_mesh(cfg)
    x, y = _batch(cfg)
    grads = []
    for lib in (impl, timpl):
        model = build_fsdp(lib, cfg, mesh)
        loss = lm_loss(model(x), y)
        with torch.no_grad():
            for p in model.layers[-1].parameters():
                p.mul_(1.5)
        loss.backward()
        grads.append({n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None})
    for n in grads[1]:
        assert_close(f"grad of {n!r} with the last block scaled between forward and backward", grads[0][n], grads[1][n], dict(rtol=1e-6, atol=1e-6))


def check(kind: str, **kw):
    {
        "isinstance": check_isinstance_and_return,
        "dtensor_params": check_parameters_are_dtensors,
        "unshard_reshard": check_unshard_reshard,
        "registered_after_forward": check_registered_params_after_forward,
        "no_sync": check_no_sync,
        "torch_policies": check_torch_policy_objects,
        "forward_method": check_register_fsdp_forward_method,
        "memory": check_unsharded_memory,
        "modified_between": check_modified_between_forward_and_backward,
    }[kind](**kw)


def _api_grid():
    configs = [
        dict(kind="isinstance"),
        dict(kind="dtensor_params", model="even"),
        dict(kind="dtensor_params", model="odd"),
        dict(kind="unshard_reshard"),
        dict(kind="registered_after_forward", reshard=True),
        dict(kind="registered_after_forward", reshard=False),
        dict(kind="registered_after_forward", reshard=None),
        dict(kind="no_sync"),
        dict(kind="torch_policies"),
        dict(kind="forward_method"),
        dict(kind="memory", reshard=True),
        dict(kind="memory", reshard=True, prefetch=True),
        dict(kind="memory", reshard=True, ac=True),
        dict(kind="memory", reshard=True, mp="bf16", prefetch=True),
        dict(kind="memory", reshard=None),
        dict(kind="memory", reshard=False),
        dict(kind="modified_between"),
    ]
    run_grid(configs, check, name="api")


def test_api_world_size_2():
    run_distributed(_api_grid, 2)


class _FakeWork:
    """Completes on its `done_after`-th is_completed() poll; records wait()."""

    def __init__(self, done_after: int):
        self.done_after, self.polls, self.waited = done_after, 0, False

    def is_completed(self) -> bool:
        self.polls += 1
        return self.polls >= self.done_after

    def wait(self) -> bool:
        self.waited = True
        return True


def test_cpu_collective_wait_polls_then_waits(monkeypatch):
    from fsdp_native import _streams

    st = _streams.Streams(torch.device("cpu"))
    monkeypatch.setattr(_streams, "SPIN_S", 1.0)
    w = _FakeWork(done_after=5)
    st.wait_work(w)
    assert w.polls == 5 and w.waited, f"polled {w.polls} times, waited={w.waited}; expected 5 polls then wait()"
    # A collective that does not finish within the budget is waited on (blocking) after it.
    monkeypatch.setattr(_streams, "SPIN_S", 0.002)
    w = _FakeWork(done_after=10**9)
    st.wait_work(w)
    assert w.waited and w.polls > 1
    # FSDP_NATIVE_SPIN_US=0: no polling at all.
    monkeypatch.setattr(_streams, "SPIN_S", 0.0)
    w = _FakeWork(done_after=1)
    st.wait_work(w)
    assert w.waited and w.polls == 0, f"polled {w.polls} times with polling off"


def test_cpu_wait_does_not_poll_fake_process_group_work(monkeypatch):
    # torch's fake process group (dry runs, memory estimates) hands out works whose
    # is_completed() stays False though wait() returns at once: polling one would spin the
    # whole budget on every collective.
    from fsdp_native import _streams

    FakeWork = torch._C._distributed_c10d.FakeWork
    yields = []
    monkeypatch.setattr(_streams, "SPIN_S", 1.0)
    monkeypatch.setattr(_streams.os, "sched_yield", lambda: yields.append(1))
    _streams.Streams(torch.device("cpu")).wait_work(FakeWork())
    assert not yields, f"polled a fake process group's work {len(yields)} times"


@pytest.mark.parametrize("raw", ["abc", "-5", "1.5"])
def test_env_switch_rejects_bad_values(monkeypatch, raw):
    from fsdp_native._env import non_negative_int

    monkeypatch.setenv("FSDP_NATIVE_SPIN_US", raw)
    with pytest.raises(ValueError) as e:
        non_negative_int("FSDP_NATIVE_SPIN_US", 5000, "microseconds")
    assert str(e.value) == (
        f"fsdp_native: environment variable FSDP_NATIVE_SPIN_US must be a non-negative integer (microseconds), got {raw!r}"
    )


def test_env_switch_values(monkeypatch):
    from fsdp_native._env import non_negative_int

    monkeypatch.delenv("FSDP_NATIVE_P2P_MIN_BYTES", raising=False)
    assert non_negative_int("FSDP_NATIVE_P2P_MIN_BYTES", 4 << 20, "bytes") == 4 << 20
    monkeypatch.setenv("FSDP_NATIVE_P2P_MIN_BYTES", " 0 ")
    assert non_negative_int("FSDP_NATIVE_P2P_MIN_BYTES", 4 << 20, "bytes") == 0


def test_bad_env_switch_fails_import():
    import subprocess
    import sys

    env = dict(os.environ, FSDP_NATIVE_P2P_MIN_BYTES="4MiB")
    r = subprocess.run([sys.executable, "-c", "import fsdp_native"], env=env, capture_output=True, text=True)
    assert r.returncode != 0
    assert "environment variable FSDP_NATIVE_P2P_MIN_BYTES must be a non-negative integer (bytes), got '4MiB'" in r.stderr, r.stderr[-500:]
