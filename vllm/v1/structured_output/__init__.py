"""Structured outputs: a request's constraint -> a grammar -> a token bitmask per step.

```
 frontend (Processor, HTTP)   validate_structured_outputs(params): xgrammar parses the
                              schema / regex / EBNF (no tokenizer needed); a constraint
                              it cannot parse is a 400 naming the field, before the engine
 engine core (scheduler)      GrammarCompiler.submit(params) -> Future: a thread pool
                              compiles against the tokenizer, cached by params.key();
                              the request waits in WAITING_FOR_FSM meanwhile
                              (v1/core/sched/structured_outputs.py)
 worker (runner, sampler)     a GrammarMatcher per request fills its rows of the batch's
                              token bitmask each step; the sampler sets the logits of
                              refused tokens to -inf (v1/worker/grammar_bitmask.py)
```

Two backends, chosen by `--structured-outputs-config '{"backend": ...}'` (vLLM's names):
xgrammar (the default) and llguidance ("guidance"; "llguidance" is accepted too,
guidance.py). "auto", as in vLLM, takes xgrammar and falls back to llguidance for a
constraint xgrammar cannot parse (`choose_backend`). Both fill the same int32 bitmask
([rows, ceil(V / 32)], bit t = token t allowed), so the sampler's path is one. xgrammar's
`Grammar.from_*` parsers only read the constraint; its `GrammarCompiler` needs the
tokenizer's vocabulary and takes milliseconds to seconds (a large schema), which is
why compiles run off the engine step.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from vllm.exceptions import VLLMValidationError
from vllm.logger import init_logger
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.structured_output.reasoning import REASONING_TAGS, ReasoningTokens

if TYPE_CHECKING:
    import xgrammar as xgr

logger = init_logger(__name__)

# Backends `--structured-outputs-config '{"backend": ...}'` accepts -> the one that runs
# ("auto": xgrammar, else llguidance, per constraint; "llguidance": this fork's alias).
STRUCTURED_OUTPUT_BACKENDS = {"auto": "auto", "xgrammar": "xgrammar", "guidance": "guidance",
                              "llguidance": "guidance"}
# Compiled grammars kept (least recently used dropped first); a JSON-schema grammar for a
# 50k vocabulary is ~10-100 KiB.
GRAMMAR_CACHE_SIZE = 1024


def build_grammar(params: StructuredOutputsParams) -> xgr.Grammar:
    """The xgrammar `Grammar` of a constraint (parsing only: no tokenizer, no compile).

    Raises:
        VLLMValidationError (parameter = the constraint's field: "json", "regex",
            "choice", "grammar", "structural_tag"): xgrammar cannot parse it; the
            message carries xgrammar's reason.
    """
    import xgrammar as xgr

    kind = params.kind
    value = getattr(params, kind)
    try:
        if kind == "json":
            # strict_mode (xgrammar's default): properties and items the schema does not
            # name are refused, which is what disable_additional_properties asks for.
            return xgr.Grammar.from_json_schema(
                value, any_whitespace=not params.disable_any_whitespace, strict_mode=True)
        if kind == "json_object":  # any object (vLLM's), extra properties allowed
            return xgr.Grammar.from_json_schema(
                '{"type": "object"}', any_whitespace=not params.disable_any_whitespace,
                strict_mode=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(value)
        if kind == "choice":
            # EBNF string literals take JSON's escapes: any choice is matched verbatim.
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in value))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(value)
        return _structural_tag_grammar(value)
    except VLLMValidationError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own errors
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise VLLMValidationError(
            f"structured output {kind} cannot be compiled by xgrammar: {reason}",
            parameter=kind, value=value) from e


def _structural_tag_grammar(value: str | dict) -> xgr.Grammar:
    """xgrammar's structural tag; vLLM's older form {"structures": [{"begin", "schema",
    "end"}], "triggers": [...]} is converted to its tag items."""
    import xgrammar as xgr

    tag = json.loads(value) if isinstance(value, str) else value
    if isinstance(tag, dict) and "structures" in tag:
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]),
                                       end=s["end"]) for s in tag["structures"]]
        return xgr.Grammar.from_structural_tag(items, tag.get("triggers", []))
    return xgr.Grammar.from_structural_tag(tag)


def choose_backend(params: StructuredOutputsParams, backend: str = "auto") -> str:
    """The backend that compiles `params` on an engine configured with `backend`:
    "xgrammar" or "guidance" (parsed here, so the choice is known to work).

    Raises:
        VLLMValidationError: the backend cannot parse the constraint (`build_grammar`,
            `guidance.build_guidance_grammar`); under "auto", xgrammar's error when
            neither can.
    """
    from vllm.v1.structured_output.guidance import build_guidance_grammar

    backend = STRUCTURED_OUTPUT_BACKENDS.get(backend, backend)
    if backend == "guidance":
        build_guidance_grammar(params)
        return backend
    try:
        build_grammar(params)
        return "xgrammar"
    except VLLMValidationError:
        if backend != "auto" or params.kind == "structural_tag":
            raise
        try:
            build_guidance_grammar(params)
        except VLLMValidationError:
            pass
        else:
            return "guidance"
        raise


def validate_structured_outputs(params: StructuredOutputsParams | None,
                                backend: str = "auto") -> None:
    """Check in the frontend that the engine's backend can compile the constraint
    (None: nothing).

    Raises:
        VLLMValidationError: see `choose_backend`.
    """
    if params is not None:
        choose_backend(params, backend)


def check_backend(requested: str | None, engine_backend: str = "auto",
                  parameter: str = "backend") -> None:
    """A request's own backend choice (vLLM's `guided_decoding_backend`): as in vLLM V1,
    only the engine's backend (`--structured-outputs-config`) may be named.

    Raises:
        VLLMValidationError (`parameter`): another backend (None passes: the engine's).
    """
    resolve = STRUCTURED_OUTPUT_BACKENDS.get
    if requested is not None and resolve(requested, requested) != resolve(engine_backend):
        raise VLLMValidationError(
            f"structured output backend {requested!r} cannot be chosen per request: this "
            f"engine runs {engine_backend!r} (--structured-outputs-config); leave the field "
            "out or restart with that backend", parameter=parameter)


class CompiledGrammar:
    """A compiled grammar as it travels from the engine core to the workers.

    In one process (the uni executor) it is passed by reference. Pickled (to
    worker processes) it travels as xgrammar's JSON serialization with its
    tokenizer info and is rebuilt on the other side.

    Attributes:
        grammar: the `xgrammar.CompiledGrammar`.
        reasoning: the reasoning tags' ids when the grammar applies only after the
            reasoning (`reasoning.ReasoningTokens`), else None.
    """

    def __init__(self, grammar: xgr.CompiledGrammar,
                 reasoning: ReasoningTokens | None = None) -> None:
        self.grammar = grammar
        self.reasoning = reasoning

    def new_matcher(self) -> xgr.GrammarMatcher:
        """A request's matcher (accept_token, fill_next_token_bitmask, rollback,
        is_terminated); `guidance.GuidanceGrammar` makes one with the same verbs."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.grammar)

    def __reduce__(self):
        return (_rebuild_compiled_grammar, (
            self.grammar.serialize_json(), self.grammar.tokenizer_info.serialize_json(),
            self.reasoning))


def _rebuild_compiled_grammar(grammar_json: str, tokenizer_json: str,
                              reasoning: ReasoningTokens | None) -> CompiledGrammar:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(tokenizer_json)
    return CompiledGrammar(xgr.CompiledGrammar.deserialize_json(grammar_json, info), reasoning)


class GrammarCompiler:
    """Compiles constraints in a thread pool against one tokenizer; caches by key.

    The xgrammar compiler (it needs the tokenizer's vocabulary, ~0.2 s to
    build for a 50k vocabulary) is made by the first job, in the pool, so
    neither start-up nor a request's path pays for it. xgrammar's C++ compile
    releases the GIL, so the engine step keeps running meanwhile.

    Args:
        tokenizer_factory: returns the model's HF tokenizer (called once, in the pool).
        vocab_size: the logits' width (the model's vocabulary, >= the tokenizer's).
        stop_token_ids: tokens that end a grammar's output (the model's EOS ids).
        max_workers: compile threads.
        backend: the engine's backend (`STRUCTURED_OUTPUT_BACKENDS`: "auto", "xgrammar",
            "guidance" / "llguidance").
        tokenizer_path: the tokenizer's path, which llguidance's grammars carry (a
            worker process rebuilds its tokenizer from it); needed for "guidance"/"auto".
        reasoning_tags: `--reasoning-parser`'s `REASONING_TAGS` entry: every grammar then
            applies after the end tag only (its compiled grammar carries their ids);
            None: from the reply's first token.
    """

    def __init__(self, tokenizer_factory, vocab_size: int, stop_token_ids: list[int],
                 max_workers: int = 2, backend: str = "auto",
                 tokenizer_path: str | None = None,
                 reasoning_tags: tuple[str, str, bool] | None = None) -> None:
        self.backend = backend
        self.reasoning_tags = reasoning_tags
        self._reasoning: list[ReasoningTokens | None] = []  # resolved by the first job
        self.tokenizer_path = tokenizer_path
        self._tokenizer_factory = tokenizer_factory
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()  # the cache (taken by submit, on the engine step)
        # Building the compiler (tokenizer load) takes its own lock: a submit never waits.
        self._compiler_lock = threading.Lock()
        self._compiler: xgr.GrammarCompiler | None = None
        self._cache: dict[tuple, Future[CompiledGrammar]] = {}  # insertion order = LRU
        self.num_compiles = 0  # cumulative, cache misses

    def submit(self, params: StructuredOutputsParams) -> Future[CompiledGrammar]:
        """A future of the compiled constraint (done at once on a cache hit).

        The future raises `VLLMValidationError` when the constraint does not compile.
        """
        key = params.key()
        with self._lock:
            future = self._cache.pop(key, None)
            if future is None or (future.done() and future.exception() is not None):
                future = self._pool.submit(self._compile, params)
                self.num_compiles += 1
            self._cache[key] = future
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                del self._cache[next(iter(self._cache))]
        return future

    def _compile(self, params: StructuredOutputsParams):
        """A `CompiledGrammar` (xgrammar) or a `guidance.GuidanceGrammar`."""
        backend = STRUCTURED_OUTPUT_BACKENDS.get(self.backend, self.backend)
        if backend != "guidance":
            try:
                grammar = build_grammar(params)
            except VLLMValidationError:
                if backend != "auto" or choose_backend(params, backend) != "guidance":
                    raise
            else:
                return CompiledGrammar(self._get_compiler().compile_grammar(grammar),
                                       self._reasoning_tokens())
        from vllm.v1.structured_output.guidance import GuidanceGrammar, build_guidance_grammar

        return GuidanceGrammar(self.tokenizer_path, self.vocab_size, self.stop_token_ids,
                               build_guidance_grammar(params), self._reasoning_tokens())

    def _reasoning_tokens(self) -> ReasoningTokens | None:
        """The reasoning tags' ids (looked up in the tokenizer once, in the pool)."""
        if self.reasoning_tags is None:
            return None
        with self._compiler_lock:
            if not self._reasoning:
                self._reasoning.append(
                    ReasoningTokens.of(self.reasoning_tags, self._tokenizer_factory()))
            return self._reasoning[0]

    def _get_compiler(self) -> xgr.GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                tokenizer = self._tokenizer_factory()
                stop_ids = set(self.stop_token_ids)
                if tokenizer.eos_token_id is not None:
                    stop_ids.add(tokenizer.eos_token_id)
                info = xgr.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self.vocab_size, stop_token_ids=sorted(stop_ids))
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def grammar_compiler_for(vllm_config: Any) -> GrammarCompiler:
    """The engine core's compiler for its model (the tokenizer is loaded lazily, in the
    pool); the grammars' stop tokens are the generation config's EOS ids and the
    tokenizer's."""
    from vllm.transformers_utils.tokenizer import get_tokenizer

    model_config, config = vllm_config.model_config, vllm_config.structured_outputs_config
    eos = (model_config.try_get_generation_config() or {}).get("eos_token_id")
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    return GrammarCompiler(lambda: get_tokenizer(model_config.tokenizer),
                           model_config.get_vocab_size(), eos_ids,
                           backend=config.backend, tokenizer_path=model_config.tokenizer,
                           reasoning_tags=REASONING_TAGS.get(config.reasoning_parser))
