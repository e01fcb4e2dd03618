"""Runtime switches read from the environment at import."""
from __future__ import annotations

import os


def non_negative_int(name: str, default: int, unit: str) -> int:
    """The value of environment variable `name` as an integer >= 0 (`default` when unset)."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"fsdp_native: environment variable {name} must be a non-negative integer ({unit}), got {raw!r}")
    return value


def one_of(name: str, default: str, choices: tuple[str, ...]) -> str:
    """The value of environment variable `name`, one of `choices` (`default` when unset)."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value not in choices:
        raise ValueError(f"fsdp_native: environment variable {name} must be one of {', '.join(choices)}, got {raw!r}")
    return value
