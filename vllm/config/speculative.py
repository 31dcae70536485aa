"""`SpeculativeConfig`: speculative decoding (`--speculative-config`, vLLM's keys).

```
{"method": "ngram", "num_speculative_tokens": k,
 "prompt_lookup_max": 5, "prompt_lookup_min": 2}      prompt lookup, no extra model
{"method": "draft_model", "model": PATH, "num_speculative_tokens": k}
                                                      a smaller model, same vocabulary;
                                                      its KV shares the target's blocks
```
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from vllm.config.frozen import FrozenConfig

SPEC_METHODS = ("ngram", "draft_model")
# Methods this engine runs; a known method missing here is rejected by name.
IMPLEMENTED_SPEC_METHODS = ("ngram", "draft_model")
# vLLM's default n-gram window when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5


class SpeculativeConfigError(ValueError):
    """A bad speculative_config value; `key` names the offending key."""

    def __init__(self, message: str, key: str) -> None:
        super().__init__(f"speculative_config: {message}")
        self.key = key


@dataclass
class SpeculativeConfig(FrozenConfig):
    """How drafts are proposed and how many the target verifies per step.

    Attributes:
        method: "ngram" (prompt lookup) or "draft_model".
        num_speculative_tokens: k, draft tokens per request per step (>= 1);
            the target scores k + 1 positions per request.
        prompt_lookup_max / prompt_lookup_min: ngram only, the longest and
            shortest suffix (tokens) matched against the earlier context. One
            given: both take it; none: both `DEFAULT_PROMPT_LOOKUP` (vLLM's).
        model: draft_model only, the draft model's path.

    Raises:
        SpeculativeConfigError (a ValueError carrying `key`): unknown method or
            keys, a count < 1, min > max, a model with ngram, no model with
            draft_model, or a method this engine does not implement yet.
    """

    method: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method is None and self.model is not None:
            self.method = "draft_model"  # vLLM infers the method from a model
        if self.method not in SPEC_METHODS:
            raise SpeculativeConfigError(
                f"method must be one of {list(SPEC_METHODS)}, got {self.method!r}", "method"
            )
        _check_int("num_speculative_tokens", self.num_speculative_tokens, required=True)
        if self.method == "ngram":
            self._resolve_ngram()
        else:
            self._check_draft_model()
        if self.method not in IMPLEMENTED_SPEC_METHODS:
            raise SpeculativeConfigError(
                f"method {self.method!r} is not implemented by this engine yet "
                f"(implemented: {list(IMPLEMENTED_SPEC_METHODS)})",
                "method",
            )

    def _resolve_ngram(self) -> None:
        if self.model is not None:
            raise SpeculativeConfigError(
                f"model is only used with method 'draft_model', not 'ngram' (got {self.model!r})",
                "model",
            )
        _check_int("prompt_lookup_max", self.prompt_lookup_max)
        _check_int("prompt_lookup_min", self.prompt_lookup_min)
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = DEFAULT_PROMPT_LOOKUP
        self.prompt_lookup_min = hi if lo is None else lo
        self.prompt_lookup_max = lo if hi is None else hi
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise SpeculativeConfigError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                f"({self.prompt_lookup_max})",
                "prompt_lookup_min",
            )

    def _check_draft_model(self) -> None:
        if not self.model:
            raise SpeculativeConfigError("method 'draft_model' needs a model path", "model")
        for key in ("prompt_lookup_max", "prompt_lookup_min"):
            if getattr(self, key) is not None:
                raise SpeculativeConfigError(
                    f"{key} is only used with method 'ngram', not 'draft_model'", key
                )

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots a request holds beyond this step's tokens for the draft model's k
        decode steps (0 for ngram, whose drafts need slots only when verified)."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0

    @classmethod
    def from_dict(cls, values: Any) -> SpeculativeConfig:
        if not isinstance(values, dict):
            raise SpeculativeConfigError(
                f"must be a JSON object, got {values!r}", "speculative_config"
            )
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(allowed))
        if unknown:
            raise SpeculativeConfigError(
                f"unknown keys {unknown}; supported: {allowed}", unknown[0]
            )
        return cls(**values)

    @classmethod
    def from_cli(cls, text: str) -> SpeculativeConfig:
        """Parse the `--speculative-config` JSON string."""
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpeculativeConfigError(
                f"not valid JSON ({e}): {text!r}", "speculative_config"
            ) from e
        return cls.from_dict(values)

    @classmethod
    def coerce(cls, value: Any) -> SpeculativeConfig | None:
        """None, a dict, a JSON string or a SpeculativeConfig -> a config (or None)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            return cls.from_cli(value)
        return cls.from_dict(value)


def _check_int(key: str, value: Any, required: bool = False) -> None:
    if value is None and not required:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SpeculativeConfigError(f"{key} must be an integer >= 1, got {value!r}", key)
