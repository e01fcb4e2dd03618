"""Structure agreement: at the first forward every rank checks that all ranks sharded the same
modules the same way, and every rank raises the same ``ValueError`` naming what differs.

A different structure per rank makes the ranks issue different collectives: gloo then aborts
the process (a size mismatch) or blocks until its timeout, and a same-sized mismatch silently
mixes data of different units. So before its first collective a root checks, for every unit
under it: the modules (their paths from the root, in order), every parameter's name, shape,
dtype, requires_grad and shard dim, and the policies (mixed precision, reshard_after_forward, offload,
mesh shape). This runs once per root, at lazy init, and nothing runs inside ``fully_shard``:
a rank that skipped a ``fully_shard`` call issues the same collectives as the others until
here.

The exchange is fixed-size first: one all-gather of 4 int64 (units, parameters, elements,
a hash of the whole description) on the root unit's shard group, and for HSDP a second one on
its replicate group that also carries whether the shard group agreed (every replicate group
holds one rank of each shard group, so after it every rank of the mesh knows). Only on a
mismatch are the descriptions themselves gathered (``all_gather_object`` on the same two
groups), so every rank builds the same message from the same data.
"""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_native import _compat, _stall
from fsdp_native._streams import streams_for

MAX_DIFFS = 4


def first_forward(root: nn.Module, units: list) -> None:
    """Lazy init of `root`: checks the structure across ranks, then lets the stall watch
    count this root's steps."""
    check_structure(root, units)
    _stall.attach(root)


def check_structure(root: nn.Module, units: list) -> None:
    """Raises ValueError on every rank of the root unit's mesh if their units differ."""
    if not units or not dist.is_initialized():
        return
    info = root._fsdp_native_unit.info
    desc = describe(root, units)
    groups = [g for g in (info.shard_group, info.replicate_group) if g is not None and dist.get_world_size(g) > 1]
    if not groups:
        return
    mine = _signature(desc)
    ok = True
    for group in groups:
        table = _all_gather_ints(mine + [int(ok)], group, info.device)
        ok = ok and all(row[:4] == mine for row in table) and all(row[4] for row in table)
    if ok:
        return
    # Every rank of the mesh saw a mismatch: gather the descriptions over the same groups.
    known = {dist.get_rank(): desc}
    for group in groups:
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, known, group=group)
        known = {r: d for part in gathered for r, d in part.items()}
    raise ValueError(mismatch_message(known))


def describe(root: nn.Module, units: list) -> dict:
    """This rank's structure under `root`, as plain data."""
    paths = {id(m): name for name, m in root.named_modules(remove_duplicate=False)}
    out = []
    for u in units:
        params = []
        layout = u.layout
        for owner, shape, dtype, rg, dim in zip(u.owners, layout.shapes, layout.orig_dtypes, layout.requires_grad, layout.dims):
            mod, attr = owner[0]
            prefix = paths.get(id(mod), "?")
            params.append((f"{prefix}.{attr}" if prefix else attr, tuple(shape), str(dtype).replace("torch.", ""), rg, dim))
        raf = u.reshard_after_forward if u.post_forward is None else u.post_forward[1]
        out.append(
            {
                "path": ", ".join(_show(paths.get(id(m), "?")) for m in u.modules),
                "params": params,
                "mp_policy": _mp_repr(u),
                "reshard_after_forward": raf,
                "offload_policy": repr(u.offload) if u.offload is not None else "OffloadPolicy()",
                "mesh": tuple(u.info.mesh.mesh.shape),
            }
        )
    return {"root": _class_name(root), "units": out}


def _mp_repr(u) -> str:
    """The unit's policy as text equal across ranks: a param_dtype_override_fn shows as the
    unsharded dtypes it chose (its repr holds an address)."""
    if u.mp.param_dtype_override_fn is None:
        return repr(u.mp)
    dtypes = [str(d).replace("torch.", "") for d in u.layout.param_dtypes]
    return f"{u.mp!r} with param_dtype_override_fn giving {dtypes}"


def _show(path: str) -> str:
    return path or "<root>"


def _class_name(m: nn.Module) -> str:
    cls = type(m)
    if cls.__module__ == "fsdp_native._fully_shard" and len(cls.__bases__) == 2:  # FSDP<Class>
        cls = cls.__bases__[1]
    return cls.__name__


def _signature(desc: dict) -> list[int]:
    units = desc["units"]
    digest = hashlib.blake2b(repr(desc).encode(), digest_size=8).digest()
    return [
        len(units),
        sum(len(u["params"]) for u in units),
        sum(_numel(p[1]) for u in units for p in u["params"]),
        int.from_bytes(digest, "little", signed=True),
    ]


def _numel(shape: tuple) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _all_gather_ints(values: list[int], group, device: torch.device) -> list[list[int]]:
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    table = torch.empty(dist.get_world_size(group) * len(values), dtype=torch.int64, device=device)
    work = _compat.all_gather_single(table, mine, group=group, async_op=True)
    streams_for(device).wait_work(work)  # on CPU: watched for stalls like the runtime's waits
    return table.cpu().view(-1, len(values)).tolist()


# --------------------------------------------------------------------------------------------
# the message


def _ranks_by(values: dict[int, object]) -> list[tuple[object, list[int]]]:
    """Distinct values in rank order, each with the ranks holding it."""
    groups: dict = {}
    for r in sorted(values):
        groups.setdefault(repr(values[r]), (values[r], []))[1].append(r)
    return list(groups.values())


def _differs(what: str, values: dict[int, object], fmt=repr) -> str:
    """'<what> <v1> on ranks [..] but <v2> on ranks [..]' (more values: comma-separated)."""
    parts = [f"{fmt(v)} on ranks {ranks}" for v, ranks in _ranks_by(values)]
    return f"{what} " + (" but ".join(parts) if len(parts) == 2 else ", ".join(parts))


def mismatch_message(descs: dict[int, dict]) -> str:
    head = "fsdp_native: the fully_shard structure differs across ranks (checked at the first forward): "
    tail = "; fully_shard must be called on the same modules with the same settings on every rank"
    ranks = sorted(descs)
    roots = {r: descs[r]["root"] for r in ranks}
    if len(set(roots.values())) > 1:  # e.g. fully_shard(root) skipped: a child became the root
        parts = []
        for cls, rs in _ranks_by(roots):
            units = descs[rs[0]]["units"]
            paths = ", ".join(f"'{u['path']}'" for u in units)
            parts.append(f"a {cls} with {len(units)} unit{'s' if len(units) != 1 else ''} ({paths}) on ranks {rs}")
        return head + "the first forward's root is " + " but ".join(parts) + tail
    diffs: list[str] = []
    # Units by path, in the order of first appearance.
    order: list[str] = []
    where: dict[str, dict[int, tuple[int, dict]]] = {}
    for r in ranks:
        for i, u in enumerate(descs[r]["units"]):
            if u["path"] not in where:
                order.append(u["path"])
                where[u["path"]] = {}
            where[u["path"]][r] = (i, u)
    details: list[str] = []  # after the units that exist on some ranks only, the likelier cause
    for path in order:
        have = where[path]
        i = next(iter(have.values()))[0]
        name = f"unit {i} '{path}'"
        if len(have) < len(ranks):
            missing = [r for r in ranks if r not in have]
            diffs.append(f"{name} exists on ranks {sorted(have)} but not on {missing}")
            continue
        details += _unit_diffs(name, {r: u for r, (_, u) in have.items()}, ranks)
    diffs += details
    if not diffs:
        seqs = {r: [u["path"] for u in descs[r]["units"]] for r in ranks}
        diffs.append(_differs("the order of the units is", seqs))
    shown = diffs[:MAX_DIFFS]
    more = f"; and {len(diffs) - MAX_DIFFS} more difference(s)" if len(diffs) > MAX_DIFFS else ""
    return head + "; ".join(shown) + more + tail


def _unit_diffs(name: str, units: dict[int, dict], ranks: list[int]) -> list[str]:
    out = []
    params = {r: {p[0]: p for p in u["params"]} for r, u in units.items()}
    names: list[str] = []
    for r in ranks:
        names += [n for n in params[r] if n not in names]
    for pname in names:
        have = [r for r in ranks if pname in params[r]]
        if len(have) < len(ranks):
            out.append(f"{name}: parameter '{pname}' exists on ranks {have} but not on {[r for r in ranks if r not in have]}")
            continue
        for idx, what in ((1, "has shape"), (2, "has dtype"), (3, "has requires_grad"), (4, "is sharded on dim")):
            values = {r: params[r][pname][idx] for r in ranks}
            if len({repr(v) for v in values.values()}) > 1:
                fmt = (lambda v: str(tuple(v))) if idx == 1 else str
                out.append(f"{name}: parameter '{pname}' {_differs(what, values, fmt)}")
    for key in ("mp_policy", "reshard_after_forward", "offload_policy", "mesh"):
        values = {r: units[r][key] for r in ranks}
        if len({repr(v) for v in values.values()}) > 1:
            out.append(f"{name}: {_differs(key + ' is', values, str)}")
    if not out:
        orders = {r: [p[0] for p in units[r]["params"]] for r in ranks}
        if len({repr(v) for v in orders.values()}) > 1:
            out.append(f"{name}: the order of its parameters differs")
    return out
