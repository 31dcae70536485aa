"""`LazyRegistry`: classes by name, each imported on first use."""

from __future__ import annotations

from collections.abc import Mapping
from importlib import import_module
from typing import Generic, TypeVar

T = TypeVar("T")


class LazyRegistry(Generic[T]):
    """Classes by name, each given as "package.module:ClassName" and imported only when
    asked for, so a CLI lists and checks the names (`--help`, start-up validation)
    without importing any of them (nor what they import: pydantic models, tokenizers).

    Args:
        kind: what the classes are, for messages ("reasoning parser").
        entries: name -> "package.module:ClassName".
    """

    def __init__(self, kind: str, entries: Mapping[str, str]) -> None:
        self.kind = kind
        self._entries = dict(entries)

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._entries)

    def get(self, name: str) -> type[T]:
        """The class registered as `name` (its module imported now).

        Raises:
            KeyError: no class of that name (the message lists the names).
        """
        if name not in self._entries:
            raise KeyError(f"unknown {self.kind} {name!r}; choose from "
                           f"{', '.join(self.names())}")
        module, cls = self._entries[name].split(":")
        return getattr(import_module(module), cls)
