"""The tensors of a module's inputs and outputs, as FSDP2 finds them: through torch's pytree
(lists, tuples, dicts, namedtuples and every registered node, Hugging Face's ``ModelOutput``
among them) and also inside dataclass instances that pytree does not know, which torch FSDP2
looks into from torch 2.12 on (its inputs' casts on every version): a block that takes and
returns ``@dataclass`` states gets its inputs cast to ``param_dtype``, its post-backward
registered on their tensors and its pre-backward hooked on its outputs' tensors."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree


def _open_dataclass(x: Any) -> bool:
    """A dataclass instance that pytree takes for a leaf."""
    return dataclasses.is_dataclass(x) and not isinstance(x, type) and type(x) not in pytree.SUPPORTED_NODES


def _fields(x: Any) -> list[str]:
    # Only the fields __init__ takes: dataclasses.replace rebuilds from those.
    return [f.name for f in dataclasses.fields(x) if f.init]


def tensors(tree: Any) -> list[torch.Tensor]:
    """Every tensor of `tree`, in the order :func:`map_tensors` visits them."""
    out = []
    for x in pytree.tree_flatten(tree)[0]:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif _open_dataclass(x):
            out.extend(tensors([getattr(x, name) for name in _fields(x)]))
    return out


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    """`tree` with every tensor ``t`` replaced by ``fn(t)``; a dataclass is rebuilt with
    ``dataclasses.replace`` where a field changed, as torch FSDP2 rebuilds it."""

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return fn(x)
        if _open_dataclass(x):
            names = _fields(x)
            old = [getattr(x, name) for name in names]
            new = map_tensors(fn, old)
            changed = {n: v for n, o, v in zip(names, old, new) if v is not o}
            return dataclasses.replace(x, **changed) if changed else x
        return x

    return pytree.tree_map(leaf, tree)
