"""The scheduler side of structured outputs: requests wait for their grammar's compile.

    add_request(R)        R has `sampling_params.structured_outputs`: its compile is
                          submitted (a thread pool, vllm/v1/structured_output) and R
                          waits in WAITING_FOR_FSM, keeping its place in the queue
    schedule()            promote(): R whose compile finished get their grammar
                          (`Request.grammar`) and become WAITING; `_schedule_waiting`
                          skips R while it still waits, so every other request keeps
                          stepping; a compile that failed is handed back to be finished
    package_plan          R's grammar reaches the runner with R (NewRequestData.grammar),
                          which masks R's logits each step (v1/worker/grammar_bitmask.py)

`SchedulerStructuredOutputs` is a component of the `Scheduler` (its
`structured_outputs` field); it owns the compiles in flight and moves no
request between queues. The compiler itself lives above the core (it needs
xgrammar and the tokenizer); the core names only `GrammarSource`.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from vllm.logger import init_logger
from vllm.v1.request import RequestStatus

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = init_logger(__name__)


class GrammarSource(Protocol):
    """What the scheduler calls to compile a constraint (`GrammarCompiler` implements it)."""

    def submit(self, params: Any) -> Future: ...


class SchedulerStructuredOutputs:
    """Compiles in flight, by request.

    Args:
        compiler: where constraints compile, or None (a structured request is then
            refused when added: the engine was built without one).

    Attributes:
        compiling: request id -> (the request, its compile's future).
        failed: request id -> why its compile failed (finished at the next update).
    """

    def __init__(self, compiler: GrammarSource | None) -> None:
        self.compiler = compiler
        self.compiling: dict[str, tuple[Request, Future]] = {}
        self.failed: dict[str, str] = {}

    def start(self, request: Request) -> None:
        """Submit the request's compile if it has a constraint; it then waits (WAITING_FOR_FSM).

        Raises:
            ValueError: a constrained request and no compiler.
        """
        params = request.sampling_params.structured_outputs
        if params is None:
            return
        if self.compiler is None:
            raise ValueError("this engine has no grammar compiler for structured outputs")
        future = self.compiler.submit(params)
        if future.done() and future.exception() is None:  # a cached grammar: no wait
            request.grammar = future.result()
            return
        self.compiling[request.request_id] = (request, future)
        request.status = RequestStatus.WAITING_FOR_FSM

    def promote(self) -> None:
        """Give each request whose compile is done its grammar and make it WAITING;
        failed compiles go to `failed`; requests finished meanwhile are forgotten."""
        for req_id, (request, future) in list(self.compiling.items()):
            if request.is_finished():
                del self.compiling[req_id]
            elif future.done():
                del self.compiling[req_id]
                error = future.exception()
                if error is None:
                    request.grammar = future.result()
                    request.status = RequestStatus.WAITING
                else:
                    logger.warning("request %s: its grammar did not compile: %s", req_id, error)
                    self.failed[req_id] = f"its structured output did not compile: {error}"

    def take_failed(self) -> dict[str, str]:
        """The failed compiles since the last call (request id -> error message)."""
        failed, self.failed = self.failed, {}
        return failed
