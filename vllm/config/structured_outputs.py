"""`StructuredOutputsConfig`: the engine's structured-output backend and its defaults
(`--structured-outputs-config`, vLLM's keys)::

    {"backend": "auto" | "xgrammar" | "guidance", "disable_any_whitespace": false,
     "reasoning_parser": null | "qwen3" | "deepseek_r1"}

xgrammar (vLLM's default) and llguidance ("guidance"; this fork also takes
"llguidance") ship with this engine; "auto" is xgrammar with llguidance for what
xgrammar cannot parse. "outlines" and "lm-format-enforcer" are refused at start-up by
name. With a `reasoning_parser` (`vllm serve --reasoning-parser` sets it, as in vLLM),
a grammar constrains only what follows the reasoning's end tag.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from vllm.config.frozen import FrozenConfig
from vllm.v1.structured_output.reasoning import REASONING_TAGS

# vLLM's backend names; this engine runs the first three (and "llguidance" = "guidance").
KNOWN_BACKENDS = ("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer")
AVAILABLE_BACKENDS = ("auto", "xgrammar", "guidance", "llguidance")


@dataclass
class StructuredOutputsConfig(FrozenConfig):
    """How constraints compile.

    Attributes:
        backend: "auto" (xgrammar, falling back to llguidance per constraint, as in
            vLLM), "xgrammar", or "guidance" / "llguidance" (llguidance).
        disable_any_whitespace: every JSON constraint is compact (no optional
            whitespace), as if each request set `disable_any_whitespace`; keeps
            small models from looping on whitespace.
        reasoning_parser: a `REASONING_TAGS` name, or None: a constrained reply of a
            reasoning model is free until the end tag (`</think>`) and constrained
            after it (vLLM's rule; v1/structured_output/reasoning.py).

    Raises:
        ValueError: an unknown key, a backend that is not available (named), a
            value of the wrong type.
    """

    backend: str = "auto"
    disable_any_whitespace: bool = False
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in AVAILABLE_BACKENDS:
            known = "is not available in this engine" if self.backend in KNOWN_BACKENDS else \
                "is unknown"
            raise ValueError(
                f"structured_outputs_config: backend {self.backend!r} {known}; "
                f"use one of {list(AVAILABLE_BACKENDS)}")
        if self.reasoning_parser not in (None, *REASONING_TAGS):
            raise ValueError(f"structured_outputs_config: reasoning_parser "
                             f"{self.reasoning_parser!r} is not one of {sorted(REASONING_TAGS)}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs_config: disable_any_whitespace must be a "
                             f"bool, got {self.disable_any_whitespace!r}")

    @classmethod
    def coerce(cls, value: Any) -> StructuredOutputsConfig:
        """None (the defaults), a dict, a JSON string or a config -> a config.

        Raises:
            ValueError: see the class; also JSON that does not parse or is not an object.
        """
        if value is None:
            return cls()
        if isinstance(value, StructuredOutputsConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs_config: not valid JSON ({e}): "
                                 f"{value!r}") from e
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs_config must be a JSON object, got {value!r}")
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(allowed))
        if unknown:
            raise ValueError(f"structured_outputs_config: unknown keys {unknown}; "
                             f"supported: {allowed}")
        return cls(**value)
