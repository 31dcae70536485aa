"""`@rpc`: the mark that makes a worker method callable by the engine through an executor.

    EngineCore:  executor.collective_rpc(Worker.load_model, args=(plan,))
                     |  the method object itself (typed: a rename or a typo fails at
                     |  the call site, and a type checker sees the arguments)
    executor:    its name travels to every rank's process
    rank:        WorkerWrapper.execute_method: the worker's own attribute of that
                 name (an override in a subclass wins), called only if @rpc marks it

What a worker offers the engine is exactly its `@rpc` methods: the list is
the code, not a table kept beside it. A plain function (not a marked method)
may also be sent; it is called as `fn(worker, *args)` (tests and benchmarks
reading a rank's state).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)

_MARK = "__vllm_rpc__"


def rpc(method: F) -> F:
    """Mark a worker method as callable through `Executor.collective_rpc`."""
    setattr(method, _MARK, True)
    return method


def is_rpc(method: object) -> bool:
    """Whether `method` (a function or a bound method) carries the `@rpc` mark."""
    return bool(getattr(method, _MARK, False))
