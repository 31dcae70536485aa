"""On/off switches read from the environment (`VLLM_*` kernel switches)."""

from __future__ import annotations

import os

_VALUES = {"1": True, "true": True, "on": True, "0": False, "false": False, "off": False}


def env_flag(name: str, default: bool) -> bool:
    """The switch `name`: 1/true/on or 0/false/off (any case, surrounding spaces
    ignored); `default` when unset.

    Raises:
        ValueError: any other value (a typo is an error, not a guess).
    """
    value = os.environ.get(name)
    if value is None:
        return default
    flag = _VALUES.get(value.strip().lower())
    if flag is None:
        raise ValueError(f"{name} must be 1/true/on or 0/false/off, got {value.strip()!r}")
    return flag
