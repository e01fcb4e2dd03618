"""Train a small transformer with fsdp_native on CPU ranks (gloo); checkpoint and resume with DCP.

    .venv/bin/torchrun --standalone --nproc_per_node 2 scripts/train_demo.py [--impl torch] [--steps N]
        [--bf16] [--all-gather fp8|fp8_tensorwise|nf4]

``--all-gather`` turns on fsdp_native's quantized all-gather for the blocks (fp8 or NF4 bytes
on the wire, dequantized for compute); the summary's "communication per step" shows the
bytes. NF4 is for frozen weights, so ``--all-gather nf4`` trains QLoRA-style: the blocks' Linear
weights frozen, rank-16 adapters beside them (``--lora RANK``).

Task: copy. Each sequence is a random half of HALF tokens followed by the same half again; the
model is trained on next-token prediction over the second half, so the loss starts near
ln(VOCAB) and drops towards 0 once the blocks learn to attend HALF positions back. Batches
are drawn from a generator seeded by (step, rank), so a resumed run sees the same data an
uninterrupted run would.

Every block is one fully_shard unit; the root unit holds the embeddings, final norm and
output projection. At the end the model, optimizer and step are saved with
fsdp_native.checkpoint (torch.distributed.checkpoint underneath, get_state_dict /
set_state_dict) into a new directory under checkpoints/demo (step-<N>), committed only once
every rank has written its part, keeping the last --keep; the next run resumes from the newest
complete one and trains --steps more steps. A run killed during the save leaves the previous
checkpoint intact.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from fsdp_native import checkpoint as ckpt

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CKPT = os.path.join(REPO_ROOT, "checkpoints", "demo")


# --------------------------------------------------------------------------------------------
# model


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention + MLP."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class LoRALinear(nn.Module):
    """A frozen Linear plus a trainable low-rank update (QLoRA's adapters): ``base(x) +
    up(down(x)) * scale``, ``up`` zero-initialised so training starts from the base model."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float = 16.0):
        super().__init__()
        self.base = base
        self.base.weight.requires_grad_(False)
        self.down = nn.Linear(base.in_features, rank, bias=False)
        self.up = nn.Linear(rank, base.out_features, bias=False)
        nn.init.zeros_(self.up.weight)
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x)) * self.scale


def add_lora(model: "Transformer", rank: int) -> None:
    """Wraps every Linear of the blocks in a LoRALinear (frozen weight, trainable adapters)."""
    for block in model.blocks:
        for name, child in list(block.named_children()):
            if isinstance(child, nn.Linear):
                setattr(block, name, LoRALinear(child, rank))


class Transformer(nn.Module):
    def __init__(self, vocab: int, seq_len: int, dim: int, heads: int, layers: int):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, dim)
        self.pos_emb = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def copy_batch(step: int, rank: int, batch: int, half: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    first = torch.randint(vocab, (batch, half), generator=g)
    seq = torch.cat([first, first], dim=1)
    return seq[:, :-1], seq[:, 1:]


# --------------------------------------------------------------------------------------------
# checkpoint


class TrainState(Stateful):
    """Model + optimizer + step, as DCP saves and loads them."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int = 0):
        self.model, self.optimizer, self.step = model, optimizer, step

    def state_dict(self):
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, "step": self.step}

    def load_state_dict(self, state_dict) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
        )
        self.step = int(state_dict["step"])


def show_path(path: str) -> str:
    """Relative to the repository root when inside it."""
    rel = os.path.relpath(path, REPO_ROOT)
    return path if rel.startswith("..") else rel


# --------------------------------------------------------------------------------------------
# implementations


def load_impl(name: str):
    """-> (fully_shard, unsharded-peak-bytes reader or None, peak reset or None)."""
    if name == "torch":
        from torch.distributed.fsdp import fully_shard

        return fully_shard, None, None
    import fsdp_native
    from fsdp_native import fully_shard

    def peak_bytes(model):
        return fsdp_native.unsharded_stats(model).peak_bytes

    return fully_shard, peak_bytes, fsdp_native.reset_unsharded_peak


ALL_GATHER_FORMATS = {"fp8": "fp8_rowwise", "fp8_rowwise": "fp8_rowwise", "fp8_tensorwise": "fp8_tensorwise", "nf4": "nf4"}


def shard(model: "Transformer", fully_shard, *, all_gather: str = "plain", bf16: bool = False, compile: bool = False) -> None:
    """One unit per block plus the root, as in torch's FSDP2 tutorial. ``all_gather``: a key
    of ALL_GATHER_FORMATS for fsdp_native's quantized all-gather of the blocks (the root's
    embeddings and head stay plain); ``bf16``: bf16 compute with fp32 reductions;
    ``compile``: each block compiled (``block.compile()``) before its ``fully_shard``, as
    torchtitan does."""
    kw = {}
    if bf16:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    block_kw = dict(kw)
    if all_gather != "plain":
        from fsdp_native import QuantizedAllGather

        block_kw["all_gather"] = QuantizedAllGather(ALL_GATHER_FORMATS[all_gather])
    for block in model.blocks:
        if compile:
            block.compile()
        fully_shard(block, **block_kw)
    fully_shard(model, **kw)


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


# --------------------------------------------------------------------------------------------
# summary


@dataclasses.dataclass
class DemoSummary:
    impl: str
    world_size: int
    start_step: int
    end_step: int
    first_loss: float
    final_loss: float
    step_times: list[float]  # seconds, this run's steps
    peak_unsharded_bytes: int | None  # max over this run's steps (rank 0), None if not exposed
    checkpoint_path: str
    model: nn.Module | None = None  # for summaries that inspect the runtime's statistics
    extra: dict = dataclasses.field(default_factory=dict)


TRACE_STEPS = 10


def comm_summary(recorder, step_times: list[float]) -> dict:
    """Per-step bytes of each collective and exposed communication (time the training thread
    waited on communication) over the traced steps, from rank 0's recorder."""
    per_step = recorder.bytes_summary()
    n = max(len(per_step), 1)
    totals: dict[str, int] = {}
    for units in per_step.values():
        for by_kind in units.values():
            for kind, nbytes in by_kind.items():
                totals[kind] = totals.get(kind, 0) + nbytes
    moved = ", ".join(f"{kind} {fmt_bytes(nbytes / n)}" for kind, nbytes in sorted(totals.items()))
    stall_ms = recorder.stall_us() / 1e3 / n
    step_ms = 1e3 * statistics.fmean(step_times) if step_times else math.nan
    return {
        f"communication per step (rank 0, last {n} steps)": moved or "none",
        "exposed communication per step": f"{stall_ms:.1f} ms of {step_ms:.1f} ms ({100 * stall_ms / step_ms:.0f}%: "
        "compute waiting on all-gathers and reduce-scatters)",
    }


def print_summary(summary: DemoSummary) -> None:
    """Printed by rank 0 at the end of a run.

    Hook: extend here (e.g. bytes moved and exposed communication time from the runtime's
    statistics on `summary.model`) without touching the training loop.
    """
    times = summary.step_times
    lines = [
        f"summary ({summary.impl}, {summary.world_size} ranks): steps {summary.start_step} -> {summary.end_step}",
        f"  loss: {summary.first_loss:.4f} -> {summary.final_loss:.4f} (final)",
        f"  step time: mean {1e3 * statistics.fmean(times):.1f} ms, median {1e3 * statistics.median(times):.1f} ms"
        if times
        else "  step time: no steps run",
        f"  peak unsharded bytes (rank 0): {fmt_bytes(summary.peak_unsharded_bytes)}",
        f"  checkpoint: {summary.checkpoint_path}",
    ]
    for key, value in summary.extra.items():
        lines.append(f"  {key}: {value}")
    print("\n".join(lines), flush=True)


# --------------------------------------------------------------------------------------------
# main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=["fsdp_native", "torch"], default="fsdp_native")
    p.add_argument("--steps", type=int, default=120, help="steps to train in this run (default 120)")
    p.add_argument("--ckpt-dir", default=DEFAULT_CKPT, help="directory of the checkpoints (default checkpoints/demo)")
    p.add_argument("--keep", type=int, default=3, help="complete checkpoints to keep (default 3)")
    p.add_argument("--fresh", action="store_true", help="ignore an existing checkpoint and start from step 0")
    p.add_argument("--no-save", action="store_true", help="do not write a checkpoint at the end")
    p.add_argument("--batch", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--half", type=int, default=24, help="length of the random half of each sequence")
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--all-gather",
        choices=["plain", *ALL_GATHER_FORMATS],
        default="plain",
        help="fsdp_native's quantized all-gather for the blocks: fp8 (= fp8_rowwise), fp8_tensorwise or nf4 "
        "(nf4 quantizes frozen weights only, so it implies --lora 16 unless given); default plain",
    )
    p.add_argument("--bf16", action="store_true", help="bf16 compute (MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32))")
    p.add_argument("--compile", action="store_true", help="torch.compile each block before fully_shard (torchtitan's order)")
    p.add_argument("--lora", type=int, default=0, metavar="RANK",
                   help="QLoRA-style fine-tuning: freeze the blocks' Linear weights and train rank-RANK adapters beside them")
    args = p.parse_args(argv)
    if args.all_gather != "plain" and args.impl != "fsdp_native":
        p.error(f"--all-gather {args.all_gather} is fsdp_native's own; --impl {args.impl} has no quantized all-gather")
    if args.all_gather == "nf4" and args.lora == 0:
        args.lora = 16
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")  # torch FSDP2 and fsdp_native, on the logits
    # c10d's renamed collectives (all_gather_into_tensor -> all_gather_single, ...), once per process
    warnings.filterwarnings("ignore", message=".*is deprecated. Please use.*", category=FutureWarning)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    is_main = rank == 0

    fully_shard, peak_bytes, reset_peak = load_impl(args.impl)
    torch.manual_seed(args.seed)  # same initial weights on every rank
    model = Transformer(args.vocab, 2 * args.half - 1, args.dim, args.heads, args.layers)
    if args.lora:
        add_lora(model, args.lora)
    n_params = sum(p.numel() for p in model.parameters())
    shard(model, fully_shard, all_gather=args.all_gather, bf16=args.bf16, compile=args.compile)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    state = TrainState(model, optimizer)

    if is_main:
        print(
            f"impl={args.impl} ranks={world} params={n_params / 1e6:.2f}M units={args.layers + 1} "
            f"task=copy(vocab={args.vocab}, half={args.half}) batch/rank={args.batch} all_gather={args.all_gather}"
            f"{' compute=bf16' if args.bf16 else ''}{f' lora={args.lora}' if args.lora else ''}{' compile' if args.compile else ''}",
            flush=True,
        )
    resumed = None if args.fresh else ckpt.load_latest({"train": state}, args.ckpt_dir)
    if is_main:
        if resumed is not None:
            print(f"resumed from step {state.step} ({show_path(args.ckpt_dir)})", flush=True)
        else:
            print(f"no checkpoint at {show_path(args.ckpt_dir)}: starting from step 0", flush=True)

    start = state.step
    bar = None
    if is_main:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, desc="train", unit="step", dynamic_ncols=True, mininterval=0.25)
    times: list[float] = []
    losses: list[float] = []
    run_peak = None
    # The last steps run under fsdp_native's recorder: bytes moved and time compute waited on
    # communication, for the summary (torch FSDP2 has no recorder).
    traced_from = start + max(0, args.steps - TRACE_STEPS)
    tracing = contextlib.ExitStack()
    recorder = None
    for step in range(start, start + args.steps):
        if step == traced_from and args.impl == "fsdp_native":
            import fsdp_native

            recorder = tracing.enter_context(fsdp_native.record_trace())
        inputs, targets = copy_batch(step, rank, args.batch, args.half, args.vocab)
        if reset_peak is not None:
            reset_peak(model)
        t0 = time.perf_counter()
        logits = model(inputs)
        loss = F.cross_entropy(
            logits[:, args.half - 1 :].float().reshape(-1, args.vocab), targets[:, args.half - 1 :].reshape(-1)
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - t0)

        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        losses.append(mean_loss.item() / world)
        state.step = step + 1
        if bar is not None:
            step_peak = peak_bytes(model) if peak_bytes is not None else None
            if step_peak is not None:
                run_peak = step_peak if run_peak is None else max(run_peak, step_peak)
            bar.set_postfix_str(
                f"step={step + 1} loss={losses[-1]:.4f} step_time={1e3 * times[-1]:.0f}ms "
                f"unsharded_peak={fmt_bytes(step_peak)}",
                refresh=False,
            )
            bar.update(1)
    tracing.close()
    if bar is not None:
        bar.close()

    saved = None if args.no_save else ckpt.save({"train": state}, args.ckpt_dir, state.step, keep=args.keep)
    if is_main:
        print_summary(
            DemoSummary(
                impl=args.impl,
                world_size=world,
                start_step=start,
                end_step=state.step,
                first_loss=losses[0] if losses else math.nan,
                final_loss=losses[-1] if losses else math.nan,
                step_times=times,
                peak_unsharded_bytes=run_peak,
                checkpoint_path=show_path(saved) if saved is not None else f"{show_path(args.ckpt_dir)} (not saved: --no-save)",
                model=model,
                extra=comm_summary(recorder, times[traced_from - start :]) if recorder is not None else {},
            )
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
