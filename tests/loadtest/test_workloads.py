"""The agent workload: its conversations' shape, their tool calls and results, what later
turns repeat, and that specserve accepts every request of it."""

import json
from itertools import groupby, pairwise
from typing import Any

import pytest

from loadtest.agent_tasks import TASKS
from loadtest.workloads import AGENT, BUNDLED, WorkItem, load
from server.protocol.chat import ChatCompletionRequest
from server.protocol.limits import DEFAULT_LIMITS

TURNS = 6  # the task, then after each of five tool results
CONVERSATIONS = [list(turns) for _, turns in groupby(AGENT, lambda i: i.id.rsplit("-", 1)[0])]


def messages(item: WorkItem) -> list[dict[str, Any]]:
    assert item.conversation is not None
    return list(item.conversation)


def calls(item: WorkItem) -> list[dict[str, Any]]:
    """The tool calls of the turn's history, in order."""
    return [call for m in messages(item) for call in m.get("tool_calls") or ()]


def outputs(item: WorkItem) -> list[str]:
    return [m["content"] for m in messages(item) if m["role"] == "tool"]


def written(item: WorkItem) -> list[str]:
    """The contents of the files the agent wrote, in order."""
    return [
        json.loads(call["function"]["arguments"])["content"]
        for call in calls(item)
        if call["function"]["name"] == "write_file"
    ]


def test_agent_is_bundled_with_one_conversation_per_task() -> None:
    assert load("agent") is BUNDLED["agent"] is AGENT
    assert len(AGENT) == len(TASKS) * TURNS == 24
    assert len({item.id for item in AGENT}) == len(AGENT)
    assert [[item.id for item in turns] for turns in CONVERSATIONS] == [
        [f"agent-{task.name}-turn{turn}" for turn in range(1, TURNS + 1)] for task in TASKS
    ]


@pytest.mark.parametrize("turns", CONVERSATIONS, ids=[task.name for task in TASKS])
def test_each_turn_is_the_one_before_with_a_tool_call_and_its_result(
    turns: list[WorkItem],
) -> None:
    assert all(item.endpoint == "chat" and item.messages is None for item in turns)
    assert [m["role"] for m in messages(turns[0])] == ["system", "user"]
    for before, after in pairwise(turns):
        grown = messages(after)
        assert grown[: len(messages(before))] == messages(before)
        assert [m["role"] for m in grown[len(messages(before)) :]] == ["assistant", "tool"]
    assert [call["function"]["name"] for call in calls(turns[-1])] == [
        "read_file", "write_file", "run_tests", "write_file", "run_tests",
    ]  # fmt: skip


@pytest.mark.parametrize("item", AGENT, ids=[item.id for item in AGENT])
def test_every_tool_result_answers_a_declared_call_of_the_turn_before(item: WorkItem) -> None:
    assert item.tools is not None
    declared = {tool["function"]["name"]: tool["function"] for tool in item.tools}
    history = messages(item)
    ids = [call["id"] for call in calls(item)]
    assert len(set(ids)) == len(ids)
    for previous, message in pairwise(history):
        if message["role"] != "tool":
            continue
        assert previous["role"] == "assistant" and previous["content"] is None
        (call,) = previous["tool_calls"]
        assert message["tool_call_id"] == call["id"]
        function = declared[call["function"]["name"]]
        arguments = json.loads(call["function"]["arguments"])
        assert sorted(arguments) == sorted(function["parameters"]["required"])


@pytest.mark.parametrize("turns", CONVERSATIONS, ids=[task.name for task in TASKS])
def test_later_turns_repeat_earlier_tool_results_and_replies(turns: list[WorkItem]) -> None:
    last = turns[-1]
    for turn, item in enumerate(turns):
        assert len(outputs(item)) == turn
        assert outputs(last)[:turn] == outputs(item)
    source = outputs(last)[0]  # the file as read
    first, fixed = written(last)
    # What the agent writes repeats most of what it read, then of what it wrote before.
    for earlier, later in ((source, first), (first, fixed)):
        lines = later.splitlines()
        kept = sum(line in earlier.splitlines() for line in lines)
        assert kept / len(lines) >= 0.8 and later != earlier
    run, rerun = (c for c in calls(last) if c["function"]["name"] == "run_tests")
    assert run["function"] == rerun["function"]


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("item", AGENT, ids=[item.id for item in AGENT])
def test_specserve_accepts_every_request(item: WorkItem, stream: bool) -> None:
    payload = item.payload("qwen2.5-coder-1.5b-instruct", 96, 0.0, stream)
    body = ChatCompletionRequest.model_validate(payload)
    DEFAULT_LIMITS.check_chat(body)
    assert len(body.offered_tools()) == 8 and body.tool_choice is None
    assert [m.role for m in body.messages] == [m["role"] for m in messages(item)]
