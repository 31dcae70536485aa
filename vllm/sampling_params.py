"""`SamplingParams`: how to sample one request, validated at construction.

Field names, defaults and ranges follow vLLM's, so user code written for vLLM
runs unchanged. Every invalid value raises `VLLMValidationError` (a
`ValueError`) naming the field and the allowed range; its `parameter` is the
field. Also here: the request-level checks both the offline `LLM`
and the OpenAI server run before a request reaches the engine
(`validate_request_lengths`, `validate_token_ids`).
"""

from __future__ import annotations

import copy
import enum
import json as json_module
import math
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from typing import Any

from vllm.exceptions import VLLMValidationError
from vllm.logger import init_logger

logger = init_logger(__name__)

# Below this temperature a request is greedy (argmax), as in vLLM.
_SAMPLING_EPS = 1e-5
# Temperatures in (_SAMPLING_EPS, _MAX_TEMP) are raised to _MAX_TEMP: dividing
# float32 logits by a smaller number overflows to inf and the softmax to NaN.
_MAX_TEMP = 1e-2
# The most logprobs (sample and prompt) one request may ask for by default: vLLM's
# default `max_logprobs` (`--max-logprobs`), enforced by the engine's Processor.
MAX_LOGPROBS = 20
# OpenAI's range for logit_bias values.
_MAX_ABS_LOGIT_BIAS = 100.0
# torch.Generator.manual_seed accepts exactly this range.
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1
# The deepest nesting of objects / arrays a constraint given as a dict may have (a schema
# object nests two per level: itself and its "properties"). Copying, pickling and the
# backends' parsers recurse per level; far deeper values hit Python's recursion limit.
MAX_CONSTRAINT_DEPTH = 128


# The kinds of constraint one StructuredOutputsParams holds (exactly one is set).
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """A constraint on a request's output (vLLM's `StructuredOutputsParams`).

    Exactly one of the constraint fields is set. The backend (xgrammar) turns
    it into a grammar; each sampled token must keep the output a prefix of a
    string the grammar accepts, and EOS is allowed only where the grammar may
    end. Whether the constraint compiles is checked before the request reaches
    the engine (`vllm.v1.structured_output.validate_structured_outputs`).

    Attributes:
        json: a JSON schema (dict or JSON string): the output is one JSON value
            that validates against it.
        regex: the output matches this regular expression (xgrammar's syntax).
        choice: the output is exactly one of these strings.
        grammar: an EBNF grammar (xgrammar's / GBNF syntax, start rule `root`).
        json_object: True: the output is any JSON object.
        structural_tag: xgrammar's structural tag, as a JSON string or dict.
        disable_any_whitespace: JSON without optional whitespace (compact).
        disable_additional_properties: treat every object of the schema as
            `"additionalProperties": false` unless it says otherwise.
        whitespace_pattern: accepted for vLLM's signature; xgrammar takes no
            pattern, so only None is allowed.
        source_field: the request field the constraint came from ("response_format",
            "guided_json", "tools", ...; set by the server that builds it): an error
            found only when the engine compiles the grammar names it (HTTP 400
            `param`). Not a constraint: `from_dict` refuses it, `key()` ignores it.

    Raises:
        VLLMValidationError: none or several constraints, a field of the wrong type, or
            a dict (schema, structural tag) nested more than MAX_CONSTRAINT_DEPTH deep.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    source_field: str = "structured_outputs"

    def __post_init__(self) -> None:
        set_kinds = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise VLLMValidationError(
                f"structured_outputs needs exactly one of {list(STRUCTURED_OUTPUT_KINDS)}, "
                f"got {set_kinds or 'none'}", parameter="structured_outputs")
        kind = set_kinds[0]
        value = getattr(self, kind)
        allowed = {"json": (str, dict), "regex": (str,), "choice": (list,), "grammar": (str,),
                   "json_object": (bool,), "structural_tag": (str, dict)}[kind]
        if not isinstance(value, allowed) or (kind == "choice" and not (
                value and all(isinstance(c, str) for c in value))):
            what = "a non-empty list of strings" if kind == "choice" else " or ".join(
                t.__name__ for t in allowed)
            raise VLLMValidationError(f"structured_outputs.{kind} must be {what}, got "
                                      f"{value!r:.80}", parameter=kind, value=value)
        if isinstance(value, dict) and _nesting_depth(value) > MAX_CONSTRAINT_DEPTH:
            raise VLLMValidationError(
                f"structured_outputs.{kind} nests objects / arrays more than "
                f"{MAX_CONSTRAINT_DEPTH} levels deep", parameter=kind)
        if self.whitespace_pattern is not None:
            raise VLLMValidationError(
                "whitespace_pattern is not supported by the xgrammar backend; use "
                "disable_any_whitespace", parameter="whitespace_pattern")

    @classmethod
    def from_dict(cls, values: dict[str, Any], parameter: str = "structured_outputs"
                  ) -> StructuredOutputsParams:
        """Build from a dict of its fields (an HTTP body's `structured_outputs`).

        Raises:
            VLLMValidationError (`parameter`): an unknown key or a bad value.
        """
        known = {f.name for f in dataclass_fields(cls)} - {"source_field"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise VLLMValidationError(f"{parameter} has unknown keys {unknown}; known: "
                                      f"{sorted(known)}", parameter=parameter)
        return cls(**values)

    @property
    def kind(self) -> str:
        """Which constraint is set: one of `STRUCTURED_OUTPUT_KINDS`."""
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple:
        """A hashable key that is equal for constraints that compile to the same grammar."""
        value = getattr(self, self.kind)
        if isinstance(value, dict | list):
            value = json_module.dumps(value, sort_keys=True)
        return (self.kind, value, self.disable_any_whitespace,
                self.disable_additional_properties)


class SamplingType(enum.IntEnum):
    """How the sampler draws a row's token."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class RequestOutputKind(enum.Enum):
    """What each `RequestOutput` of a streamed request carries."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # nothing until the request finishes


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# Float fields that must be finite: inf / nan would pass (or oddly fail) the
# range checks below and turn every logit into inf or nan.
_FINITE_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty",
                  "temperature", "top_p", "min_p")


def _is_finite(value: Any) -> bool:
    """A number that is neither inf nor nan (nor an int too large for a float)."""
    if not _is_number(value):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


# Fields whose None means something other than the default (see `from_optional`).
_NONE_IS_A_VALUE = frozenset({"max_tokens", "seed", "logprobs", "prompt_logprobs",
                              "logit_bias", "best_of", "logits_processors"})


def _check(ok: bool, name: str, allowed: str, value: Any) -> None:
    if not ok:
        raise VLLMValidationError(f"{name} must be {allowed}, got {value!r}", parameter=name,
                                  value=value)


@dataclass
class SamplingParams:
    """Sampling parameters of one request (vLLM's names and defaults).

    Attributes:
        n: completions to return for the prompt (>= 1).
        presence_penalty: subtracted once from the logit of every token already
            generated, in [-2, 2] (OpenAI semantics; output tokens only).
        frequency_penalty: subtracted per occurrence of a generated token, in [-2, 2].
        repetition_penalty: > 0; logits of tokens in the prompt or output are
            divided by it when positive and multiplied when negative (HF
            semantics). 1.0 = off.
        temperature: >= 0; below 1e-5 the request is greedy.
        top_p: in (0, 1]; keep the smallest set of tokens whose probability sums to >= top_p.
        top_k: keep the k most likely tokens; 0 or -1 = off (stored as 0).
        min_p: in [0, 1]; drop tokens less likely than min_p x the top token's probability.
        seed: per-request random seed (int) or None for the engine's generator.
        stop: strings that end generation (not included in the text unless
            `include_stop_str_in_output`). Normalised to a list.
        stop_token_ids: token ids that end generation (kept in the output token ids).
        ignore_eos: keep generating after EOS.
        max_tokens: most tokens to generate (>= 1), or None for "up to max_model_len".
        min_tokens: EOS and stop tokens are masked until this many tokens are
            generated; a stop string ends only an output longer than this (vLLM's rule).
        logprobs: return this many top logprobs per generated token (plus the
            sampled token's), >= 0, or -1 for the whole vocabulary; None = no
            logprobs. The engine caps it at its `max_logprobs` (default 20).
        prompt_logprobs: the same for every prompt token after the first.
        detokenize, skip_special_tokens, spaces_between_special_tokens,
        include_stop_str_in_output: detokenization options as in vLLM.
        output_kind: what streamed outputs carry (see `RequestOutputKind`).
        logit_bias: token id -> bias in [-100, 100] added to its logit before sampling.
        best_of: accepted for vLLM's signature; None or 1 only (vLLM V1 samples no
            extra candidates either and refuses more).
        logits_processors: accepted for vLLM's signature; None or empty only
            (per-request Python logits processors are not supported, as in vLLM V1).
        structured_outputs: a `StructuredOutputsParams` (or a dict of its
            fields) constraining the output to a JSON schema, regex, choice or
            grammar; None = unconstrained.
        allowed_token_ids: only these token ids may be sampled (a non-empty
            list); None = all.
        bad_words: words never generated: each word's tokens (with and without
            a leading space, as vLLM tokenizes them; filled by
            `update_from_tokenizer`) may not complete in the output: a one-token
            word is always masked, the last token of a longer one is masked
            after its other tokens.
        truncate_prompt_tokens: keep only the last k prompt tokens (k >= 1; -1 =
            max_model_len, vLLM's meaning); applied by the engine's Processor
            before the length checks.

    Raises:
        ValueError: a field outside its range (message names the field and range).
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: dict[int, float] | None = None
    best_of: int | None = None
    logits_processors: list[Any] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    # Arbitrary per-request data for engine extensions (vLLM's `extra_args`); a KV
    # connector reads `extra_args["kv_transfer_params"]`.
    extra_args: dict[str, Any] | None = None
    # stop_token_ids plus the model's EOS ids (filled by
    # `update_from_generation_config`); masked by the sampler until min_tokens.
    _all_stop_token_ids: set[int] = field(default_factory=set, init=False, repr=False)
    # bad_words as token id sequences (`update_from_tokenizer`).
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, init=False,
                                                  repr=False)

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0  # vLLM accepts both spellings of "off"
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise VLLMValidationError(
                f"extra_args must be a dict, got {type(self.extra_args).__name__}",
                parameter="extra_args",
            )
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        self._verify_args()
        self._all_stop_token_ids = set(self.stop_token_ids)
        if self.temperature < _SAMPLING_EPS:
            # Greedy: truncation parameters cannot change the argmax.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        elif self.temperature < _MAX_TEMP:
            logger.warning(
                "temperature %s is below %s, which overflows float32 logits; using %s",
                self.temperature, _MAX_TEMP, _MAX_TEMP,
            )
            self.temperature = _MAX_TEMP

    @classmethod
    def from_optional(cls, **kwargs: Any) -> SamplingParams:
        """Build from keyword arguments where None means "the default" (API requests).

        As in vLLM, fields whose None is itself a value keep it: `max_tokens=None`
        means "up to max_model_len" (not the default 16), and `seed`, `logprobs`,
        `prompt_logprobs`, `logit_bias`, `best_of`, `logits_processors` stay None.
        """
        return cls(**{k: v for k, v in kwargs.items()
                      if v is not None or k in _NONE_IS_A_VALUE})

    def _verify_args(self) -> None:
        _check(_is_int(self.n) and self.n >= 1, "n", "an int >= 1", self.n)
        for name in _FINITE_FIELDS:
            value = getattr(self, name)
            _check(_is_finite(value), name, "a finite number", value)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2.0 <= value <= 2.0, name, "in [-2, 2]", value)
        rp = self.repetition_penalty
        _check(_is_number(rp) and rp > 0.0, "repetition_penalty", "> 0", rp)
        t = self.temperature
        _check(_is_number(t) and t >= 0.0, "temperature", ">= 0", t)
        _check(_is_number(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]",
               self.top_p)
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k",
               "0 or -1 (disabled) or >= 1", self.top_k)
        _check(_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]",
               self.min_p)
        _check(self.seed is None or (_is_int(self.seed) and _SEED_MIN <= self.seed <= _SEED_MAX),
               "seed", f"None or an int in [{_SEED_MIN}, {_SEED_MAX}]", self.seed)
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
               "max_tokens", "None or an int >= 1", self.max_tokens)
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "an int >= 0",
               self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise VLLMValidationError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
                parameter="min_tokens",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (_is_int(value) and value >= -1), name,
                   "None, -1 (the whole vocabulary) or an int >= 0", value)
        for s in self.stop:
            _check(isinstance(s, str) and s != "", "stop", "non-empty strings", s)
        for t_id in self.stop_token_ids:
            _check(_is_int(t_id) and t_id >= 0, "stop_token_ids", "token ids >= 0", t_id)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise VLLMValidationError(
                f"output_kind must be a RequestOutputKind, got {self.output_kind!r}",
                parameter="output_kind",
            )
        # vLLM raises ValueError for both (V1 supports neither); a TypeError from an
        # unknown keyword would read as a bug in the caller's code.
        _check(self.best_of is None or (_is_int(self.best_of) and self.best_of == 1), "best_of",
               "None or 1 (best_of > 1 is not supported; use n)", self.best_of)
        if self.logits_processors:
            raise VLLMValidationError(
                "logits_processors: per-request logits processors are not supported",
                parameter="logits_processors")
        self._verify_constraints()
        if self.logit_bias is not None:
            for tok, bias in self.logit_bias.items():
                _check(_is_int(tok) and tok >= 0, "logit_bias", "keyed by token ids >= 0", tok)
                _check(_is_number(bias) and abs(bias) <= _MAX_ABS_LOGIT_BIAS, "logit_bias",
                       f"valued in [-{_MAX_ABS_LOGIT_BIAS:g}, {_MAX_ABS_LOGIT_BIAS:g}]", bias)

    def _verify_constraints(self) -> None:
        """structured_outputs, allowed_token_ids, bad_words, truncate_prompt_tokens."""
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise VLLMValidationError(
                "structured_outputs must be a StructuredOutputsParams or a dict of its fields, "
                f"got {type(self.structured_outputs).__name__}", parameter="structured_outputs")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            _check(isinstance(ids, list) and bool(ids) and all(_is_int(t) and t >= 0 for t in ids),
                   "allowed_token_ids", "a non-empty list of token ids >= 0", ids)
        if self.bad_words is not None:
            _check(isinstance(self.bad_words, list) and all(
                isinstance(w, str) and w.strip() for w in self.bad_words),
                "bad_words", "a list of non-blank strings", self.bad_words)
        t = self.truncate_prompt_tokens
        _check(t is None or (_is_int(t) and (t == -1 or t >= 1)), "truncate_prompt_tokens",
               "None, -1 (max_model_len) or an int >= 1", t)

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def all_stop_token_ids(self) -> set[int]:
        """`stop_token_ids` plus the model's EOS ids once `update_from_generation_config` ran."""
        return self._all_stop_token_ids

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        """`bad_words` as token id sequences once `update_from_tokenizer` ran."""
        return self._bad_words_token_ids

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """Tokenize `bad_words` (vLLM's rule): each word as written (leading space
        stripped) and, where it tokenizes to as many tokens but a different first one,
        with a leading space, since a word mid-sentence carries the space."""
        self._bad_words_token_ids = []
        for word in self.bad_words or ():
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if plain:
                self._bad_words_token_ids.append(plain)
            if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
                self._bad_words_token_ids.append(spaced)

    @property
    def output_text_buffer_length(self) -> int:
        """Characters the detokenizer must hold back so a stop string is never streamed."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1

    def update_from_generation_config(
        self, generation_config: dict[str, Any], model_eos_token_id: int | None = None
    ) -> None:
        """Add the model's EOS ids to the stop set (as vLLM does at request intake).

        `model_eos_token_id` (the tokenizer's EOS) always stops unless
        `ignore_eos`; extra EOS ids from the generation config become
        `stop_token_ids` too.
        """
        if model_eos_token_id is not None:
            self._all_stop_token_ids.add(model_eos_token_id)
        eos_ids = generation_config.get("eos_token_id")
        if eos_ids is None:
            return
        eos_ids = {eos_ids} if isinstance(eos_ids, int) else set(eos_ids)
        eos_ids.discard(model_eos_token_id)
        if eos_ids:
            self._all_stop_token_ids.update(eos_ids)
            if not self.ignore_eos:
                self.stop_token_ids = sorted(set(self.stop_token_ids) | eos_ids)

    def verify_vocab(self, vocab_size: int) -> None:
        """Check that token ids given by the user exist in the model's vocabulary.

        Raises:
            ValueError: a `logit_bias` key or an `allowed_token_ids` id >= vocab_size
                (it would index past the logits).
        """
        if self.allowed_token_ids:
            bad = sorted(t for t in self.allowed_token_ids if t >= vocab_size)
            if bad:
                raise VLLMValidationError(
                    f"allowed_token_ids has token ids {bad} outside the vocabulary "
                    f"(vocab_size {vocab_size})", parameter="allowed_token_ids")
        if self.logit_bias:
            bad = sorted(t for t in self.logit_bias if t >= vocab_size)
            if bad:
                raise VLLMValidationError(
                    f"logit_bias has token ids {bad} outside the vocabulary "
                    f"(vocab_size {vocab_size})",
                    parameter="logit_bias",
                )

    def clone(self) -> SamplingParams:
        """An independent copy (lists, dicts and the stop set are not shared)."""
        return copy.deepcopy(self)


def _nesting_depth(value: Any) -> int:
    """How many dicts / lists deep `value` nests (1: a flat dict), without recursion."""
    depth, level = 0, [value]
    while level:
        depth += 1
        level = [child for node in level
                 for child in (node.values() if isinstance(node, dict) else node)
                 if isinstance(child, dict | list)]
    return depth


def validate_request_lengths(
    num_prompt_tokens: int,
    max_tokens: int | None,
    max_model_len: int,
    *,
    require_room_for_max_tokens: bool = True,
) -> int:
    """Check that a request fits the model's context; return its effective max_tokens.

    vLLM's two behaviours: the OpenAI server rejects a request whose prompt
    plus `max_tokens` exceeds `max_model_len` (`require_room_for_max_tokens=True`);
    the offline `LLM` only requires the prompt to fit and lets generation stop
    with finish_reason "length" at `max_model_len` (`False`). `max_tokens=None`
    means "as many as fit".

    Args:
        num_prompt_tokens: tokens in the prompt.
        max_tokens: the request's `SamplingParams.max_tokens`.
        max_model_len: the engine's context length, tokens.

    Returns:
        max_tokens, or `max_model_len - num_prompt_tokens` when it was None.

    Raises:
        ValueError: an empty prompt, a prompt of at least `max_model_len` tokens
            (no room for one output token), or prompt + max_tokens >
            max_model_len when required; the message gives all the numbers.
    """
    if num_prompt_tokens < 1:
        raise VLLMValidationError(
            "the prompt is empty: it must have at least 1 token", parameter="prompt"
        )
    if num_prompt_tokens >= max_model_len:
        raise VLLMValidationError(
            f"prompt has {num_prompt_tokens} tokens, which leaves no room to generate within "
            f"max_model_len {max_model_len}; shorten the prompt",
            parameter="prompt",
        )
    room = max_model_len - num_prompt_tokens
    if max_tokens is None:
        return room
    if require_room_for_max_tokens and max_tokens > room:
        raise VLLMValidationError(
            f"prompt has {num_prompt_tokens} tokens, plus max_tokens {max_tokens} exceeds "
            f"max_model_len {max_model_len}; reduce the prompt or max_tokens "
            f"(at most {room} here)",
            parameter="max_tokens",
        )
    return max_tokens


# The name the issue brief used; same function.
validate_prompt_length = validate_request_lengths


def validate_token_ids(
    token_ids: list[int], vocab_size: int, what: str = "prompt", parameter: str = "prompt"
) -> None:
    """Check user-given token ids (a token-id prompt) against the vocabulary.

    Args:
        what: how the message names the ids ("prompt" -> "prompt token id 7 ...").
        parameter: the request field they came from.

    Raises:
        VLLMValidationError: an id < 0 or >= vocab_size; names the position and
            both numbers.
    """
    for pos, tok in enumerate(token_ids):
        if not _is_int(tok) or not 0 <= tok < vocab_size:
            raise VLLMValidationError(
                f"{what} token id {tok!r} at position {pos} is out of the vocabulary "
                f"[0, {vocab_size})",
                parameter=parameter,
            )
