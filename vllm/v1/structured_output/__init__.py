"""Structured outputs: a request's constraint -> a grammar -> a token bitmask per step.

```
 engine start-up              backend_tokenizers.prepare: the backend's tokenizer (xgrammar's
                              TokenizerInfo / llguidance's) builds on a background thread,
                              once per process (core and each worker); nobody waits
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
tokenizer's vocabulary (built at start-up) and takes milliseconds to seconds (a large
schema), which is why compiles run off the engine step.
"""

from __future__ import annotations

import hashlib
import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from vllm.exceptions import VLLMValidationError
from vllm.logger import init_logger
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.structured_output import backend_tokenizers
from vllm.v1.structured_output.backend_tokenizers import TokenizerKey
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


def prepare_parser(backend: str = "auto") -> threading.Thread:
    """Import the backend's parser and let it parse a trivial schema once, on a daemon
    thread: the frontend's first constrained request (`validate_structured_outputs`, in
    the API server's process) would otherwise pay the import (xgrammar: ~2 s cold on the
    2-core CPU). Returns the started thread."""
    params = StructuredOutputsParams(json_object=True)
    thread = threading.Thread(target=choose_backend, args=(params, backend), daemon=True,
                              name="grammar-parser-import")
    thread.start()
    return thread


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
    worker processes) it travels as xgrammar's JSON serialization (serialized once,
    ~80 KiB for the benchmark's schema) and its tokenizer's key; the other side
    rebuilds it over its own process's TokenizerInfo for that key
    (backend_tokenizers.py: built once per process, at the worker's start-up), never
    a TokenizerInfo per grammar, and deserializes each distinct grammar once
    (`_REBUILT`).

    Args / attributes:
        grammar: the `xgrammar.CompiledGrammar`.
        tokenizer: the key of the TokenizerInfo it was compiled against.
        reasoning: the reasoning tags' ids when the grammar applies only after the
            reasoning (`reasoning.ReasoningTokens`), else None.
    """

    def __init__(self, grammar: xgr.CompiledGrammar, tokenizer: TokenizerKey,
                 reasoning: ReasoningTokens | None = None) -> None:
        self.grammar = grammar
        self.tokenizer = tokenizer
        self.reasoning = reasoning
        self._json: str | None = None  # serialized by the first pickle (shared by requests)

    def new_matcher(self) -> xgr.GrammarMatcher:
        """A request's matcher (accept_token, fill_next_token_bitmask, rollback,
        is_terminated); `guidance.GuidanceGrammar` makes one with the same verbs."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.grammar)

    def __reduce__(self):
        if self._json is None:
            self._json = self.grammar.serialize_json()
        return (_rebuild_compiled_grammar, (self._json, self.tokenizer, self.reasoning))


# A process's grammars rebuilt from pickles, by (tokenizer key, digest of the JSON), least
# recently used dropped first: every request carries its grammar, and a schema many
# requests share is deserialized once per worker process (12 ms for the benchmark's
# schema over a 128k vocabulary, on the worker's step).
_REBUILT: dict[tuple, Any] = {}
_REBUILT_LOCK = threading.Lock()


def _rebuild_compiled_grammar(grammar_json: str, tokenizer: TokenizerKey,
                              reasoning: ReasoningTokens | None) -> CompiledGrammar:
    key = (tokenizer, hashlib.blake2b(grammar_json.encode(), digest_size=16).digest())
    with _REBUILT_LOCK:
        grammar = _REBUILT.pop(key, None)
    if grammar is None:
        import xgrammar as xgr

        grammar = xgr.CompiledGrammar.deserialize_json(
            grammar_json, backend_tokenizers.get(tokenizer).info)
    with _REBUILT_LOCK:
        _REBUILT[key] = grammar
        while len(_REBUILT) > GRAMMAR_CACHE_SIZE:
            del _REBUILT[next(iter(_REBUILT))]
    rebuilt = CompiledGrammar(grammar, tokenizer, reasoning)
    rebuilt._json = grammar_json
    return rebuilt


class GrammarCompiler:
    """Compiles constraints in a thread pool against one tokenizer; caches by key.

    The backend's tokenizer (xgrammar's TokenizerInfo, or llguidance's tokenizer for
    "guidance"; seconds for a 128k vocabulary) starts building on a background thread
    when the compiler is made, at engine start-up (`backend_tokenizers.prepare`):
    start-up does not wait for it and a request's path does not pay it, unless the
    request comes before it is ready (it then waits in WAITING_FOR_FSM, as for its
    compile). xgrammar's C++ compile releases the GIL, so the engine step keeps running
    meanwhile. Under "auto", llguidance's tokenizer is built by the first constraint
    that falls back to it.

    Args:
        tokenizer_path: the model's tokenizer (`get_tokenizer`: HF directory or .gguf).
        vocab_size: the logits' width (the model's vocabulary, >= the tokenizer's).
        stop_token_ids: tokens that end a grammar's output (the model's EOS ids; the
            tokenizer's EOS is added).
        max_workers: compile threads.
        backend: the engine's backend (`STRUCTURED_OUTPUT_BACKENDS`: "auto", "xgrammar",
            "guidance" / "llguidance").
        reasoning_tags: `--reasoning-parser`'s `REASONING_TAGS` entry: every grammar then
            applies after the end tag only (its compiled grammar carries their ids);
            None: from the reply's first token.

    Attributes:
        ready: the future of the backend's tokenizer (`BackendTokenizer`, its `build_s`).
    """

    def __init__(self, tokenizer_path: str, vocab_size: int, stop_token_ids: list[int],
                 max_workers: int = 2, backend: str = "auto",
                 reasoning_tags: tuple[str, str, bool] | None = None) -> None:
        self.backend = STRUCTURED_OUTPUT_BACKENDS.get(backend, backend)
        self.reasoning_tags = reasoning_tags
        self._reasoning: list[ReasoningTokens | None] = []  # resolved by the first job
        self.tokenizer_key = TokenizerKey(backend_tokenizers.built_for(backend),
                                          tokenizer_path, vocab_size,
                                          tuple(sorted(set(stop_token_ids))))
        self.ready = backend_tokenizers.prepare(self.tokenizer_key)
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()  # the cache (taken by submit, on the engine step)
        self._compiler_lock = threading.Lock()  # the xgrammar compiler, made once
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
        if self.backend != "guidance":
            try:
                grammar = build_grammar(params)
            except VLLMValidationError:
                if self.backend != "auto" or choose_backend(params, self.backend) != "guidance":
                    raise
            else:
                return CompiledGrammar(self._get_compiler().compile_grammar(grammar),
                                       self.tokenizer_key, self._reasoning_tokens())
        from vllm.v1.structured_output.guidance import GuidanceGrammar, build_guidance_grammar

        return GuidanceGrammar(self.tokenizer_key.for_backend("guidance"),
                               build_guidance_grammar(params), self._reasoning_tokens())

    def _reasoning_tokens(self) -> ReasoningTokens | None:
        """The reasoning tags' ids (looked up in the tokenizer once, in the pool)."""
        if self.reasoning_tags is None:
            return None
        tokenizer = backend_tokenizers.get(self.tokenizer_key).tokenizer
        with self._compiler_lock:
            if not self._reasoning:
                self._reasoning.append(ReasoningTokens.of(self.reasoning_tags, tokenizer))
            return self._reasoning[0]

    def _get_compiler(self) -> xgr.GrammarCompiler:
        info = backend_tokenizers.get(self.tokenizer_key).info  # built at start-up
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def grammar_compiler_for(vllm_config: Any) -> GrammarCompiler:
    """The engine core's compiler for its model; its backend's tokenizer starts building
    now, in the background (`tokenizer_key_for`: the generation config's EOS ids and the
    tokenizer's are the grammars' stop tokens)."""
    key = backend_tokenizers.tokenizer_key_for(vllm_config)
    config = vllm_config.structured_outputs_config
    return GrammarCompiler(key.path, key.vocab_size, list(key.stop_token_ids),
                           backend=config.backend,
                           reasoning_tags=REASONING_TAGS.get(config.reasoning_parser))
