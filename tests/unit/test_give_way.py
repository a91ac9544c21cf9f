"""give_way: a full batch preempts its request of largest priority for a waiting one of
smaller priority, never two requests in turn (vLLM's own queue and statuses, a stand-in
scheduler)."""

from dataclasses import dataclass, field
from typing import Any

from vllm.v1.core.sched.request_queue import SchedulingPolicy, create_request_queue
from vllm.v1.request import RequestStatus

from server.vllm_plugins.give_way import give_way


@dataclass(eq=False)
class _Request:
    request_id: str
    priority: int
    arrival_time: float
    status: RequestStatus = RequestStatus.RUNNING

    def __lt__(self, other: "_Request") -> bool:  # vLLM's Request orders its heap so
        return (self.priority, self.arrival_time) < (other.priority, other.arrival_time)


@dataclass
class _Scheduler:
    running: list[Any]
    max_num_running_reqs: int
    policy: SchedulingPolicy = SchedulingPolicy.PRIORITY
    waiting: Any = field(default_factory=lambda: create_request_queue(SchedulingPolicy.PRIORITY))

    def _preempt_request(self, request: Any, timestamp: float) -> None:
        request.status = RequestStatus.PREEMPTED
        self.waiting.prepend_request(request)


def _flood(count: int) -> list[_Request]:
    return [_Request(f"a{i}", priority=i, arrival_time=float(i)) for i in range(count)]


def _waiting(scheduler: _Scheduler, *requests: _Request) -> None:
    for request in requests:
        request.status = RequestStatus.WAITING
        scheduler.waiting.add_request(request)


def test_a_full_batch_gives_way_to_smaller_priorities_largest_first() -> None:
    scheduler = _Scheduler(_flood(4), max_num_running_reqs=4)
    _waiting(scheduler, _Request("b0", 0, 10.0), _Request("b1", 1, 11.0))
    assert give_way(scheduler) == ["a3", "a2"]
    assert [r.request_id for r in scheduler.running] == ["a0", "a1"]
    # Now b's run first (vLLM's schedule), a's preempted wait: nothing more to give.
    assert [r.request_id for r in scheduler.waiting] == ["b0", "b1", "a2", "a3"]


def test_equal_priorities_and_a_batch_with_room_are_left_alone() -> None:
    scheduler = _Scheduler(_flood(2), max_num_running_reqs=2)
    _waiting(scheduler, _Request("b", 1, 10.0))
    assert give_way(scheduler) == []  # a1's priority is not larger
    scheduler = _Scheduler(_flood(3), max_num_running_reqs=4)
    _waiting(scheduler, _Request("b", 0, 10.0))
    assert give_way(scheduler) == []  # room: vLLM admits it


def test_a_preempted_request_does_not_preempt_back_nor_does_a_blocked_one() -> None:
    scheduler = _Scheduler(_flood(2), max_num_running_reqs=2)
    _waiting(scheduler, _Request("b", 0, 10.0))
    assert give_way(scheduler) == ["a1"]
    scheduler.running.append(scheduler.waiting.pop_request())  # b runs
    assert give_way(scheduler) == []  # a1 (1) waits beside a0 (0) and b (0)
    scheduler = _Scheduler(_flood(2), max_num_running_reqs=2)
    blocked = _Request("c", 0, 12.0, RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR)
    scheduler.waiting.add_request(blocked)
    assert give_way(scheduler) == []  # c's grammar compiles: it cannot run yet
    blocked.status = RequestStatus.WAITING
    assert give_way(scheduler) == ["a1"]


def test_more_waiting_than_slots_with_nothing_running_is_left_to_vllm() -> None:
    scheduler = _Scheduler([], max_num_running_reqs=2)
    _waiting(scheduler, *[_Request(f"b{i}", i, 10.0 + i) for i in range(5)])
    assert give_way(scheduler) == []  # vLLM's schedule fills both slots, smallest first
    assert len(scheduler.waiting) == 5


def test_first_come_first_served_is_left_to_vllm() -> None:
    scheduler = _Scheduler(_flood(2), max_num_running_reqs=2, policy=SchedulingPolicy.FCFS)
    scheduler.waiting = create_request_queue(SchedulingPolicy.FCFS)
    _waiting(scheduler, _Request("b", 0, 10.0))
    assert give_way(scheduler) == []
