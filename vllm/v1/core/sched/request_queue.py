"""The order in which waiting requests are admitted, and running ones preempted
(vLLM's `--scheduling-policy`; torch-free).

    fcfs      waiting: arrival order; a preempted request goes back to the front.
              running: admission order, so the newest admitted is preempted first.
    priority  waiting: by (Request.priority, arrival_time), lower first; a
              preempted request goes back to its place, ahead of equal keys.
              running: also by (priority, arrival_time), so when blocks run short
              the request with the worst key (running[-1]) is preempted first.

Keeping `running` sorted under the priority policy is what lets the scheduler's
preemption stay `running.pop()`: the running requests it visits before the one
that needs blocks are all better, so a victim is never one already scheduled in
this step. (vLLM picks `max(running)` and unschedules the victim if it had been
scheduled; the outcome is the same, with no undo.) A waiting request of better
priority is admitted before worse ones but does not preempt running requests
(as in vLLM V1).

Both queues are plain Python lists or deques: a waiting queue holds at most a
few thousand requests, and bisect's O(n) insert beats a heap that must be
sorted to be iterated in order (the partial-prefill policy and stats iterate it).
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from vllm.v1.request import Request


class RequestQueue(ABC):
    """The waiting queue of one scheduling policy, and where it puts admitted requests.

    Subclasses keep the requests in admission order in `_queue` (a deque or a list).
    """

    _queue: deque[Request] | list[Request]

    @abstractmethod
    def add(self, request: Request) -> None:
        """A new request: behind every request that goes before it."""

    @abstractmethod
    def prepend(self, request: Request) -> None:
        """A preempted request: ahead of every request it does not go after."""

    def prepend_all(self, requests: Iterable[Request]) -> None:
        """Requests popped in queue order and skipped this step: back in their places."""
        for request in reversed(list(requests)):
            self.prepend(request)

    def peek(self) -> Request:
        """The next request to admit (IndexError when empty)."""
        return self._queue[0]

    @abstractmethod
    def pop(self) -> Request:
        """Remove and return the next request to admit (IndexError when empty)."""

    def remove(self, request: Request) -> None:
        """Remove a request (finished or aborted while waiting); ValueError if absent."""
        self._queue.remove(request)

    def clear(self) -> None:
        self._queue.clear()

    def __iter__(self) -> Iterator[Request]:
        """The requests in admission order."""
        return iter(self._queue)

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return len(self) > 0

    @abstractmethod
    def place_running(self, running: list[Request], request: Request) -> None:
        """Put a newly admitted request into `running`, whose last element is the
        first to be preempted."""


class FCFSRequestQueue(RequestQueue):
    """First come, first served (vLLM's default policy)."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def pop(self) -> Request:
        return self._queue.popleft()

    def place_running(self, running: list[Request], request: Request) -> None:
        running.append(request)


def priority_key(request: Request) -> tuple[int, float]:
    """(priority, arrival_time in seconds): lower goes first."""
    return request.priority, request.arrival_time


class PriorityRequestQueue(RequestQueue):
    """Lowest (priority, arrival_time) first; equal keys keep their insertion order."""

    def __init__(self) -> None:
        self._queue: list[Request] = []  # sorted by priority_key

    def add(self, request: Request) -> None:
        bisect.insort_right(self._queue, request, key=priority_key)

    def prepend(self, request: Request) -> None:
        bisect.insort_left(self._queue, request, key=priority_key)

    def pop(self) -> Request:
        return self._queue.pop(0)

    def place_running(self, running: list[Request], request: Request) -> None:
        bisect.insort_right(running, request, key=priority_key)


def create_request_queue(policy: str) -> RequestQueue:
    """The waiting queue of `policy` ("fcfs" or "priority").

    Raises:
        ValueError: another policy, naming the choices.
    """
    queues = {"fcfs": FCFSRequestQueue, "priority": PriorityRequestQueue}
    if policy not in queues:
        raise ValueError(f"scheduling_policy must be one of {', '.join(queues)}, got {policy!r}")
    return queues[policy]()
