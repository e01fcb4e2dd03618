"""Crash-safe checkpoints over ``torch.distributed.checkpoint`` (DCP).

DCP writes into the directory it is given, in place: a crash in the middle of a save into a
fixed directory leaves the previous checkpoint's metadata beside half-written data files, and
that directory then fails to load or, worse, loads new data under old metadata. Here every
save goes to a new directory under ``root`` and becomes a checkpoint only once it is whole::

    root/step-00000120/               complete: DCP's files plus COMMITTED, the last file written
    root/step-00000130.tmp-<id>/      a save in progress, or one that crashed: never loaded
    root/step-00000100.trash-<id>/    a checkpoint being pruned: never loaded

``save`` writes with ``dcp.save`` (each file fsynced), waits on a barrier so every rank has
returned, and then rank 0 writes ``COMMITTED`` (fsynced) into the directory and renames it to
its final name, an atomic rename on a POSIX file system, and fsyncs ``root``. A directory is
complete when its name is ``step-<digits>`` and it holds ``COMMITTED``; anything else is
skipped by :func:`load_latest`, which warns about each one it skips. Old checkpoints are
pruned by renaming them to a ``.trash-`` name first, so a deletion cut short never leaves a
directory that looks complete.

Every rank must call :func:`save` and :func:`load_latest` (they are collectives), with the
same ``root`` on a file system all ranks share.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import time
import uuid
import warnings
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

__all__ = ["COMMIT_FILE", "CheckpointInfo", "IncompleteCheckpointWarning", "list_checkpoints", "load_latest", "save"]

COMMIT_FILE = "COMMITTED"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_PARTIAL_DIR = re.compile(r"^step-(\d+)\.(tmp|trash)-[0-9a-f]+$")

log = logging.getLogger(__name__)


class IncompleteCheckpointWarning(UserWarning):
    """:func:`load_latest` skipped a directory that is not a complete checkpoint."""


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint directory under a root.

    Attributes:
        step: the step it was saved at.
        path: its directory.
        complete: whether the save finished on every rank and was committed.
        reason: for an incomplete one, why it does not count.
    """

    step: int
    path: str
    complete: bool
    reason: str = ""


def _step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def list_checkpoints(root: str | os.PathLike) -> list[CheckpointInfo]:
    """The checkpoint directories under ``root``, complete or not, by step then name.
    Other files and directories under ``root`` are ignored."""
    root = _check_root(root)
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        path = os.path.join(root, name)
        if not os.path.isdir(path):
            continue
        m = _STEP_DIR.match(name)
        if m:
            done = os.path.isfile(os.path.join(path, COMMIT_FILE))
            found.append(CheckpointInfo(int(m.group(1)), path, done, "" if done else f"no {COMMIT_FILE} file"))
            continue
        m = _PARTIAL_DIR.match(name)
        if m:
            why = "a save that did not finish" if m.group(2) == "tmp" else "a checkpoint whose deletion did not finish"
            found.append(CheckpointInfo(int(m.group(1)), path, False, why))
    return sorted(found, key=lambda c: (c.step, c.path))


def save(
    state_dict: dict[str, Any],
    root: str | os.PathLike,
    step: int,
    *,
    keep: int | None = 3,
    process_group: dist.ProcessGroup | None = None,
) -> str:
    """Saves ``state_dict`` with ``dcp.save`` as the checkpoint of ``step`` under ``root``;
    every rank calls it. Returns the checkpoint's directory.

    Args:
        state_dict: what ``dcp.save`` takes: tensors, DTensors, ``Stateful`` objects, ...
        root: the directory that holds the checkpoints (created if missing).
        step: a non-negative integer; the directory is ``root/step-<step, 8 digits>``. Saving
            a step that already has a complete checkpoint replaces it.
        keep: how many complete checkpoints to keep, this one included (the oldest others are
            deleted); ``None`` keeps all. Directories left by saves that did not finish are
            deleted whatever ``keep`` is.
        process_group: the ranks that save (default: the whole world).
    """
    _check_state_dict(state_dict, "save")
    root = _check_root(root)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"fsdp_native.checkpoint.save: argument 'step' is {step!r}, expected a non-negative int")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"fsdp_native.checkpoint.save: argument 'keep' is {keep!r}, expected an int >= 1 or None")

    lead = _is_lead(process_group)
    final = _step_dir(root, step)
    tmp = None
    if lead:
        os.makedirs(root, exist_ok=True)
        tmp = f"{final}.tmp-{uuid.uuid4().hex[:12]}"
    tmp = _from_lead(tmp, process_group)

    dcp.save(state_dict, checkpoint_id=tmp, process_group=process_group)
    # dcp.save has returned on every rank past this point: every data file and the metadata
    # are written and fsynced.
    _barrier(process_group)
    if lead:
        _commit(tmp, final, step)
        if keep is not None:
            _prune(root, keep, final)
    # Nobody returns before the checkpoint is complete (a caller may exit right after).
    _barrier(process_group)
    log.info("fsdp_native.checkpoint: saved step %d to %s", step, final)
    return final


def load_latest(
    state_dict: dict[str, Any],
    root: str | os.PathLike,
    *,
    process_group: dist.ProcessGroup | None = None,
) -> int | None:
    """Loads the newest complete checkpoint under ``root`` into ``state_dict`` in place (with
    ``dcp.load``); every rank calls it. Directories of saves that did not finish are skipped
    with an :class:`IncompleteCheckpointWarning` naming each. Returns the step loaded, or
    ``None`` when there is no complete checkpoint (``state_dict`` is then left as it was)."""
    _check_state_dict(state_dict, "load_latest")
    root = _check_root(root)
    choice = None
    if _is_lead(process_group):
        found = list_checkpoints(root)
        complete = [c for c in found if c.complete]
        latest = complete[-1] if complete else None
        for c in found:
            if not c.complete:
                msg = f"fsdp_native.checkpoint: skipping incomplete checkpoint {c.path} ({c.reason})"
                warnings.warn(msg, IncompleteCheckpointWarning, stacklevel=2)
        if latest is not None:
            choice = (latest.step, latest.path)
    # Rank 0 decides, so every rank loads the same directory.
    choice = _from_lead(choice, process_group)
    if choice is None:
        return None
    step, path = choice
    dcp.load(state_dict, checkpoint_id=path, process_group=process_group)
    log.info("fsdp_native.checkpoint: loaded step %d from %s", step, path)
    return step


# --------------------------------------------------------------------------------------------


def _check_state_dict(state_dict, fn: str) -> None:
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"fsdp_native.checkpoint.{fn}: argument 'state_dict' is a {type(state_dict).__name__}, expected a dict")


def _check_root(root) -> str:
    if not isinstance(root, (str, os.PathLike)) or not os.fspath(root):
        raise TypeError(f"fsdp_native.checkpoint: argument 'root' is {root!r}, expected a directory path (str or os.PathLike)")
    return os.path.abspath(os.fspath(root))


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _is_lead(group) -> bool:
    return not _distributed() or dist.get_rank(group) == 0


def _from_lead(obj, group):
    if not _distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, group_src=0, group=group)
    return box[0]


def _barrier(group) -> None:
    if _distributed():
        dist.barrier(group=group)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _commit(tmp: str, final: str, step: int) -> None:
    """Marks `tmp` complete and moves it to `final`, durably, in that order."""
    marker = os.path.join(tmp, COMMIT_FILE)
    with open(marker, "w") as f:
        json.dump({"step": step, "time": time.time(), "world_size": dist.get_world_size() if _distributed() else 1}, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    root = os.path.dirname(final)
    if os.path.exists(final):  # the same step saved again: the old one goes first
        _trash(final)
    os.rename(tmp, final)
    _fsync_dir(root)


def _trash(path: str) -> None:
    """Deletes a checkpoint directory; it stops looking complete before anything is removed."""
    gone = f"{path}.trash-{uuid.uuid4().hex[:12]}"
    os.rename(path, gone)
    _fsync_dir(os.path.dirname(path))
    shutil.rmtree(gone, ignore_errors=True)


def _prune(root: str, keep: int, current: str) -> None:
    """Keeps `current` and the `keep - 1` newest other complete checkpoints; deletes the rest
    and every directory of a save that did not finish (no other save runs now: every rank is
    in this one)."""
    found = list_checkpoints(root)
    others = [c for c in found if c.complete and c.path != current]
    for c in others[: max(len(others) - (keep - 1), 0)]:
        _trash(c.path)
    for c in found:
        if not c.complete and not _STEP_DIR.match(os.path.basename(c.path)):
            shutil.rmtree(c.path, ignore_errors=True)
