"""A request's structured-output fields -> one `StructuredOutputsParams`, checked here.

vLLM's three spellings, one of them per request::

    response_format     {"type": "json_object"} | {"type": "json_schema",
                        "json_schema": {"name", "schema", "strict"}} | {"type": "text"}
    structured_outputs  {"json" | "regex" | "choice" | "grammar" | "json_object" |
                        "structural_tag": ..., "disable_any_whitespace": ...}
    guided_*            guided_json, guided_regex, guided_choice, guided_grammar
                        (+ guided_whitespace_pattern, guided_decoding_backend)

The constraint is parsed by the engine's backend (`--structured-outputs-config`:
xgrammar, llguidance, or auto) before the request reaches the engine: one it cannot
compile is a 400 whose `param` is the field the client sent; so is one that parses but
fails only when the engine core compiles it (`StructuredOutputsParams.source_field`
carries the field there). `guided_decoding_backend`
may only name the engine's backend (vLLM V1's rule).
"""

from __future__ import annotations

from typing import Any

from vllm.entrypoints.openai.errors import APIError
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.structured_output import check_backend, validate_structured_outputs

# guided_* field -> the StructuredOutputsParams field it sets.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def structured_outputs_from_request(request: Any, backend: str = "auto"
                                    ) -> StructuredOutputsParams | None:
    """The request's constraint, validated by `backend` (the engine's); None when it
    asks for none.

    Raises:
        APIError(400, param = the field sent): two kinds of constraint at once, a
            malformed `response_format` / `structured_outputs`, a
            `guided_decoding_backend` other than the engine's, or a constraint the
            backend cannot compile.
    """
    check = _checked(request, backend)
    sources = [(name, value) for name, value in check if value is not None]
    if not sources:
        return None
    if len(sources) > 1:
        names = [name for name, _ in sources]
        raise APIError(400, f"only one kind of structured output per request: got {names}",
                       names[1])
    field, build = sources[0]
    try:
        params = build()
        validate_structured_outputs(params, backend)
    except VLLMValidationError as e:
        if e.parameter == "whitespace_pattern" and field in GUIDED_FIELDS:
            field = "guided_whitespace_pattern"
        raise APIError(400, str(e), field) from e
    return params


def _checked(request: Any, backend: str) -> list[tuple[str, Any]]:
    """(field, a builder of its StructuredOutputsParams or None) per spelling."""
    try:
        check_backend(request.guided_decoding_backend, backend, "guided_decoding_backend")
    except VLLMValidationError as e:
        raise APIError(400, str(e), "guided_decoding_backend") from e
    guided = {GUIDED_FIELDS[name]: getattr(request, name) for name in GUIDED_FIELDS
              if getattr(request, name) is not None}
    guided_field = next((n for n in GUIDED_FIELDS if getattr(request, n) is not None), None)
    if request.guided_whitespace_pattern is not None and guided_field is None:
        raise APIError(400, "guided_whitespace_pattern needs a guided_* constraint",
                       "guided_whitespace_pattern")
    options = {"whitespace_pattern": request.guided_whitespace_pattern} if guided else {}
    return [
        ("response_format", _response_format(request.response_format)),
        ("structured_outputs", _structured_outputs(request.structured_outputs)),
        (guided_field or "guided_json",
         (lambda: StructuredOutputsParams(**guided, **options, source_field=guided_field))
         if guided else None),
    ]


def _structured_outputs(value: Any):
    if value is None:
        return None
    if not isinstance(value, dict):
        raise APIError(400, f"structured_outputs must be an object, got {value!r:.80}",
                       "structured_outputs")
    return lambda: StructuredOutputsParams.from_dict(value)


def _response_format(value: Any):
    """A builder for `response_format`, or None for none / {"type": "text"}."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return lambda: StructuredOutputsParams(json_object=True, source_field="response_format")
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError(400, "response_format json_schema needs "
                           "{\"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                           "response_format")
        return lambda: StructuredOutputsParams(json=schema, source_field="response_format")
    raise APIError(400, f"response_format type must be 'text', 'json_object' or "
                   f"'json_schema', got {kind or value!r:.80}", "response_format")
