"""`--scheduling-policy priority`: admission by (priority, arrival), the worst running
request preempted first; the same requests under fcfs for contrast."""

import pytest

from tests.v1.core.fake_runner import FakeRunner, make_request, make_scheduler, step
from vllm.v1.core.sched.request_queue import (
    FCFSRequestQueue,
    PriorityRequestQueue,
    create_request_queue,
)
from vllm.v1.request import RequestStatus


def _ids(requests):
    return [r.request_id for r in requests]


def _admission_order(policy: str) -> list[str]:
    """One seat (max_num_seqs=1), four one-token requests: the order they get it."""
    sched = make_scheduler(max_num_seqs=1, scheduling_policy=policy)
    for name, priority, arrival in [("A", 1, 1.0), ("B", 0, 2.0), ("C", 1, 3.0), ("D", 0, 4.0)]:
        sched.add_request(make_request(name, 4, max_tokens=1, priority=priority,
                                       arrival_time=arrival))
    res = step(sched, runner := FakeRunner(block_size=4))
    while sched.has_unfinished_requests():
        step(sched, runner, res)
    return [next(iter(so.num_scheduled_tokens)) for so in res.scheduler_outputs
            if so.num_scheduled_tokens]


def test_priority_policy_admits_lowest_priority_first_ties_by_arrival():
    assert _admission_order("priority") == ["B", "D", "A", "C"]
    assert _admission_order("fcfs") == ["A", "B", "C", "D"]


def _victim(policy: str):
    """A (priority 0), B (2), C (1) run on 4-token prompts, one block each; D (1) then
    arrives and waits for a seat. The decode step needs a block each with one free:
    one request is preempted."""
    sched = make_scheduler(num_blocks=5, max_num_seqs=3, scheduling_policy=policy)
    requests = [make_request(name, list(range(1000 * (i + 1), 1000 * (i + 1) + 4)),
                             max_tokens=8, priority=priority, arrival_time=float(i))
                for i, (name, priority) in enumerate([("A", 0), ("B", 2), ("C", 1), ("D", 1)])]
    for request in requests[:3]:
        sched.add_request(request)
    runner = FakeRunner(block_size=4)
    res = step(sched, runner)
    assert res.scheduler_outputs[0].num_scheduled_tokens == {"A": 4, "B": 4, "C": 4}
    sched.add_request(requests[3])
    step(sched, runner, res)
    return sched, res.scheduler_outputs[1]


def test_priority_policy_preempts_the_worst_running_request():
    sched, so = _victim("priority")
    assert so.preempted_req_ids == {"B"}  # the worst priority, not the newest (C)
    assert so.num_scheduled_tokens == {"A": 1, "C": 1}
    assert _ids(sched.running) == ["A", "C"]
    # B goes back to its place: behind D (priority 1), not to the front.
    assert _ids(sched.waiting) == ["D", "B"]
    assert sched.requests["B"].status == RequestStatus.PREEMPTED


def test_fcfs_policy_preempts_the_newest_running_request():
    sched, so = _victim("fcfs")
    assert so.preempted_req_ids == {"C"}
    assert so.num_scheduled_tokens == {"A": 1, "B": 1}
    assert _ids(sched.waiting) == ["C", "D"]  # the front of the queue


def test_priority_policy_keeps_running_sorted_so_the_last_is_the_victim():
    sched = make_scheduler(max_num_seqs=4, scheduling_policy="priority")
    sched.add_request(make_request("late_urgent", 4, priority=-5, arrival_time=9.0))
    sched.add_request(make_request("early_lax", 4, priority=3, arrival_time=1.0))
    res = step(sched, runner := FakeRunner(block_size=4))
    sched.add_request(make_request("mid", 4, priority=0, arrival_time=10.0))
    step(sched, runner, res)
    assert res.scheduler_outputs[1].num_scheduled_tokens == {
        "late_urgent": 1, "early_lax": 1, "mid": 4}
    assert _ids(sched.running) == ["late_urgent", "mid", "early_lax"]


def test_request_queues_order_ties_prepend_and_remove():
    a, b, c, d = (make_request(n, 4, priority=p, arrival_time=t)
                  for n, p, t in [("a", 1, 1.0), ("b", 1, 1.0), ("c", 0, 5.0), ("d", 1, 0.5)])
    queue = PriorityRequestQueue()
    for r in (a, b, c):
        queue.add(r)
    assert _ids(queue) == ["c", "a", "b"]  # equal keys keep their order
    queue.prepend(b)
    assert _ids(queue) == ["c", "b", "a", "b"]  # a preempted request: before equal keys
    queue.remove(b)
    queue.add(d)
    assert _ids(queue) == ["c", "d", "a", "b"]
    popped = [queue.pop(), queue.pop()]
    queue.prepend_all(popped)  # skipped for a step: back where they were
    assert _ids(queue) == ["c", "d", "a", "b"] and queue.peek() is c and len(queue) == 4
    fcfs = FCFSRequestQueue()
    for r in (a, b, c):
        fcfs.add(r)
    fcfs.prepend(d)
    assert _ids(fcfs) == ["d", "a", "b", "c"]
    popped = [fcfs.pop(), fcfs.pop()]
    fcfs.prepend_all(popped)
    assert _ids(fcfs) == ["d", "a", "b", "c"]
    fcfs.clear()
    assert not fcfs
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        create_request_queue("lifo")
