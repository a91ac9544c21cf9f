"""Preemption for fairness: a full batch gives way to a waiting request with a smaller
priority (vLLM glue, EngineCore process; called by the autopilot's scheduler each step).

The admission (traffic/admission_queue.py) gives each request the sequences its tenant held
when it was admitted as its priority, and admits a tenant under its share past the engine's
slots. vLLM's priority scheduling serves the smallest priority first among waiting requests,
but preempts a running one only when the KV cache runs out: with every slot taken by a
flood, a newcomer would wait for the flood's first request to end. Here, before vLLM
schedules a step, while the running batch is full, the running request with the largest
(priority, arrival) is preempted for each waiting request with a smaller priority. vLLM's
own preemption does the rest: it frees the request's KV blocks and puts it back in line,
keeping what it generated (it is recomputed when it runs again, from the prefix cache where
its blocks survive). The strict comparison keeps two requests from preempting each other
in turn.
"""

import time
from typing import Any


def give_way(scheduler: Any) -> list[str]:
    """Preempt running requests for waiting ones with smaller priorities while the batch is
    full; the ids of those preempted."""
    from vllm.v1.core.sched.request_queue import SchedulingPolicy
    from vllm.v1.request import RequestStatus

    if scheduler.policy != SchedulingPolicy.PRIORITY:
        return []
    free = scheduler.max_num_running_reqs - len(scheduler.running)
    if len(scheduler.waiting) <= free:
        return []  # every waiting request has a free slot: the usual step, no queue copied
    preempted: list[str] = []
    timestamp = time.monotonic()
    # The waiting queue iterates in priority order over a copy: preempting adds to it.
    for waiting in list(scheduler.waiting):
        if waiting.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            continue  # blocked: its grammar compiling, its KV loading
        if free > 0:
            free -= 1  # vLLM's own schedule gives it a free slot
            continue
        if not scheduler.running:
            break  # the waiting fill every slot a finished batch left: nothing runs to preempt
        victim = max(scheduler.running, key=lambda r: (r.priority, r.arrival_time))
        if victim.priority <= waiting.priority:
            break
        scheduler.running.remove(victim)
        scheduler._preempt_request(victim, timestamp)
        preempted.append(victim.request_id)
    return preempted
