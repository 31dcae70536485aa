"""The llguidance backend (vLLM's "guidance"): a constraint -> llguidance's grammar text ->
an `LLMatcher` per request, filling the same int32 token bitmask as xgrammar's.

    parse     build_guidance_grammar(params): llguidance's grammar JSON for json /
              json_object / regex / choice / grammar (Lark or GBNF); checked with
              LLMatcher.validate_grammar (no tokenizer), so a bad one is a 400
    compile   GuidanceGrammar(tokenizer, text): one template LLMatcher over the
              tokenizer's vocabulary (errors surface here), in the compile pool
    match     new_matcher(): a deep copy of the template per request, behind the
              accept / fill / rollback / is_terminated verbs of xgrammar's matcher

llguidance builds its token trie once per tokenizer and process (`LLTokenizer`,
backend_tokenizers.py, started at engine start-up for the "guidance" backend) and
computes masks lazily: a grammar's lexer is built by its first mask, which the
compile takes (in the pool, off the engine step); each later mask is
computed per step (tens of microseconds a row for the benchmark's JSON schema on the
bundled tokenizer). It does not take xgrammar's structural tags (a 400 here), nor
`whitespace_pattern` (refused by `StructuredOutputsParams` for both backends).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.structured_output import backend_tokenizers
from vllm.v1.structured_output.backend_tokenizers import TokenizerKey
from vllm.v1.structured_output.reasoning import ReasoningTokens

if TYPE_CHECKING:
    import torch

def build_guidance_grammar(params: StructuredOutputsParams) -> str:
    """llguidance's grammar definition of a constraint (parsed and checked, no tokenizer).

    Raises:
        VLLMValidationError (parameter = the constraint's field): llguidance cannot
            parse it, or it is a structural tag (xgrammar's alone).
    """
    import llguidance as llg

    kind = params.kind
    value = getattr(params, kind)
    if kind == "structural_tag":
        raise VLLMValidationError("structured output structural_tag is not supported by the "
                                  "llguidance backend; use xgrammar", parameter=kind)
    try:
        if kind in ("json", "json_object"):
            schema = json.loads(value) if isinstance(value, str) else value
            # As the xgrammar path (strict mode): properties a schema does not name are
            # refused; any object (json_object) takes any.
            schema = {"type": "object"} if kind == "json_object" else _closed(schema)
            grammar = llg.LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_flexible": not params.disable_any_whitespace})
        elif kind == "choice":
            grammar = llg.grammar_from("choice", json.dumps(list(value)))
        else:  # regex, grammar (Lark or GBNF: llguidance tells them apart)
            grammar = llg.grammar_from(kind, value)
        error = llg.LLMatcher.validate_grammar(grammar)
    except Exception as e:  # a schema that is not JSON, a type llguidance refuses
        error = str(e) or type(e).__name__
    if error:
        reason = error.strip().splitlines()[0]
        raise VLLMValidationError(
            f"structured output {kind} cannot be compiled by llguidance: {reason}",
            parameter=kind, value=value)
    return grammar


# Keywords whose value maps names to subschemas, and those whose value is data.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_DATA = ("enum", "const", "default", "examples", "required")


def _closed(schema: Any) -> Any:
    """A copy of a JSON schema whose objects say `"additionalProperties": false` where they
    say nothing (llguidance, as the JSON Schema spec, allows extra properties by default)."""
    if not isinstance(schema, dict):
        return schema
    closed = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            closed[key] = {name: _closed(sub) for name, sub in value.items()}
        elif key not in _DATA and isinstance(value, list):
            closed[key] = [_closed(sub) for sub in value]
        else:
            closed[key] = value if key in _DATA else _closed(value)
    if (schema.get("type") == "object" or "properties" in schema) and \
            "additionalProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


class GuidanceMatcher:
    """One request's llguidance matcher with xgrammar's `GrammarMatcher` verbs.

    Termination is xgrammar's: after a stop token was accepted. (llguidance's
    `is_stopped()` is already true when the grammar is complete and only a stop token
    may follow; its mask then allows just those, which is what the request needs.)
    """

    def __init__(self, matcher, stop_token_ids: frozenset[int]) -> None:
        self.matcher = matcher
        self.stop_token_ids = stop_token_ids
        self._num_accepted = 0  # tokens consumed (net of rollbacks)
        self._stopped_at: int | None = None  # _num_accepted after the stop token

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) for a token the grammar refuses.
        (Consuming a refused token would put llguidance's matcher in an error state that
        a rollback does not undo, so the token is checked first; a stop token is taken
        where the grammar may end.)"""
        if token_id in self.stop_token_ids:
            allowed = self.matcher.is_accepting()
        else:
            allowed = self.matcher.validate_tokens([token_id]) == 1
        if not allowed or not self.matcher.consume_token(token_id):
            return False
        self._num_accepted += 1
        if token_id in self.stop_token_ids:
            self._stopped_at = self._num_accepted
        return True

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of an int32 [rows, ceil(V / 32)] bitmask: bit t set = token t allowed."""
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)
        self._num_accepted -= num_tokens
        if self._stopped_at is not None and self._stopped_at > self._num_accepted:
            self._stopped_at = None

    def is_terminated(self) -> bool:
        return self._stopped_at is not None


class GuidanceGrammar:
    """A constraint compiled by llguidance for one tokenizer; picklable (a worker
    process rebuilds it from the grammar text over its own process's llguidance
    tokenizer for the key, backend_tokenizers.py: built once per process, at start-up).

    Args:
        tokenizer: the key of llguidance's tokenizer (backend "guidance"; the model's
            tokenizer path, the logits' width, the EOS ids).
        grammar: llguidance's grammar definition (`build_guidance_grammar`).
        reasoning: see `CompiledGrammar.reasoning`.

    Raises:
        VLLMValidationError (parameter "structured_outputs"): the grammar does not
            compile against this vocabulary.
    """

    def __init__(self, tokenizer: TokenizerKey, grammar: str,
                 reasoning: ReasoningTokens | None = None) -> None:
        import llguidance as llg
        import torch

        self.reasoning = reasoning
        self.tokenizer = tokenizer
        self.grammar = grammar
        built = backend_tokenizers.get(tokenizer)
        self.stop_token_ids = built.stop_token_ids
        self._template = llg.LLMatcher(built.info, grammar)
        # llguidance builds its lexer and the tokenizer's caches lazily, at the first mask
        # (seconds, the first time in a process): here, in the compile pool, not on a step.
        GuidanceMatcher(self._template, self.stop_token_ids).fill_next_token_bitmask(
            torch.empty((1, -(-tokenizer.vocab_size // 32)), dtype=torch.int32), 0)
        if self._template.is_error():  # its first line; the rest dumps the parser's state
            reason = (self._template.get_error().strip().splitlines() or ["?"])[0]
            raise VLLMValidationError(f"llguidance cannot compile the constraint: {reason}",
                                      parameter="structured_outputs")

    def new_matcher(self) -> GuidanceMatcher:
        return GuidanceMatcher(self._template.deep_copy(), self.stop_token_ids)

    def __reduce__(self):
        return (GuidanceGrammar, (self.tokenizer, self.grammar, self.reasoning))
