"""`FrozenConfig`: the base of the engine's config dataclasses, read-only once built.

A config is assigned while it is built and resolved (its own `__post_init__`,
then `VllmConfig.__post_init__`, which resolves what needs several configs or
the platform); `VllmConfig` then freezes itself and every part. After that an
assignment raises, so nothing rewrites the configuration behind the engine's
back: what start-up decides from the devices is a `StartupPlan`
(startup.py), and what is measured travels in result objects.
"""

from __future__ import annotations

import dataclasses
from typing import Any


class FrozenConfig:
    """Assignable until `freeze()`; then every assignment raises FrozenInstanceError."""

    _frozen = False

    def __setattr__(self, name: str, value: Any) -> None:
        if self._frozen:
            raise dataclasses.FrozenInstanceError(
                f"cannot assign {type(self).__name__}.{name}: an engine's configuration is "
                "read-only once built (start-up decisions are in StartupPlan)"
            )
        object.__setattr__(self, name, value)

    def freeze(self) -> None:
        object.__setattr__(self, "_frozen", True)
