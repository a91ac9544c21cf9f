"""Send one request to an OpenAI-compatible server and time it.

A chunk counts as a token chunk when it carries generated text. vLLM's
benchmark counts any chunk with choices, but servers that follow OpenAI send
the assistant role in a chunk of its own before generation starts (specserve
does so right away), which would make TTFT the time to that empty chunk. A
tool call's name and arguments count as generated text; a server that parses
calls out of the reply (specserve does) sends each call whole once the reply
ends, so a reply that is only calls has its first token timed with its last.
Nothing the server says can abort the run: HTTP errors (429 and 503 included),
error events inside a stream, truncated streams and timeouts become failed
records.
"""

import json
import time
from collections.abc import Callable
from typing import Any

import httpx

from loadtest.records import RequestRecord
from loadtest.sse import SSEParser
from loadtest.workloads import WorkItem


def chunk_text(data: dict[str, Any]) -> str:
    """Generated text in one stream chunk, completions or chat."""
    parts = []
    for choice in data.get("choices") or ():
        if choice.get("text"):
            parts.append(choice["text"])
        delta = choice.get("delta") or {}
        for key in ("content", "reasoning_content", "reasoning"):
            if delta.get(key):
                parts.append(delta[key])
        parts.append(calls_text(delta))
    return "".join(parts)


def calls_text(message: dict[str, Any]) -> str:
    """The tool calls of a message or a stream delta: each name, then its arguments."""
    return "".join(
        (call.get("function") or {}).get(key) or ""
        for call in message.get("tool_calls") or ()
        for key in ("name", "arguments")
    )


def error_message(body: bytes) -> str:
    """The OpenAI error message of a failed response, else its first bytes."""
    try:
        data = json.loads(body)
        if isinstance(data, dict):
            if isinstance(data.get("error"), dict):
                return str(data["error"].get("message"))
            if "message" in data:
                return str(data["message"])
            if "detail" in data:
                return str(data["detail"])
    except ValueError:
        pass
    return body[:200].decode("utf-8", "replace")


class StreamTimer:
    """Folds SSE data payloads, stamped with their arrival time, into a record."""

    def __init__(self, record: RequestRecord, sent: float) -> None:
        self.record = record
        self.sent = sent
        self.last: float | None = None
        self.chunks = 0
        self.done = False
        self.usage_tokens: int | None = None
        self.ended: float | None = None  # when a chunk carried a finish_reason

    def on_event(self, payload: str, now: float) -> None:
        record = self.record
        if payload.strip() == "[DONE]":
            self.done = True
            return
        data = json.loads(payload)
        if not isinstance(data, dict):
            raise ValueError(f"stream chunk is not an object: {payload[:100]}")
        if "error" in data:
            error = data["error"]
            message = error.get("message") if isinstance(error, dict) else error
            raise StreamError(str(message))
        if any(choice.get("finish_reason") for choice in data.get("choices") or ()):
            self.ended = now
        text = chunk_text(data)
        if text:
            if self.last is None:
                record.ttft = now - self.sent
            else:
                record.itl.append(now - self.last)
            self.last = now
            self.chunks += 1
            record.text += text
        usage = data.get("usage")
        if isinstance(usage, dict):
            if usage.get("completion_tokens") is not None:
                self.usage_tokens = int(usage["completion_tokens"])
            if usage.get("prompt_tokens") is not None:
                record.prompt_tokens = int(usage["prompt_tokens"])
            record.cached_tokens = cached_tokens(usage)
        if isinstance(data.get("speculation"), dict):
            record.speculation = data["speculation"]

    def finish(self) -> None:
        record = self.record
        if not self.done:
            raise StreamError("stream ended without data: [DONE]")
        # A reply may be empty (the model's first token was its end): it has no first token
        # (no TTFT), and ends when its finish_reason came.
        last = self.last if self.last is not None else self.ended
        if last is None:
            raise StreamError("no chunk carried generated text")
        record.e2el = last - self.sent
        if self.usage_tokens is not None:
            record.output_tokens = self.usage_tokens
        else:
            record.output_tokens = self.chunks
            record.output_tokens_source = "chunks"
        record.success = True


class StreamError(Exception):
    """The server reported an error, or broke the protocol, inside a 200 stream."""


async def send(
    client: httpx.AsyncClient,
    item: WorkItem,
    payload: dict[str, Any],
    record: RequestRecord,
    clock: Callable[[], float] = time.perf_counter,
) -> RequestRecord:
    """Send one request and fill `record`; never raises for server behaviour."""
    sent = clock()
    try:
        if payload.get("stream"):
            await _stream(client, item, payload, record, sent, clock)
        else:
            await _whole(client, item, payload, record, sent, clock)
    except Exception as exc:  # whatever the server did, the run goes on
        record.success = False
        record.error = record.error or f"{type(exc).__name__}: {exc}"
    return record


async def _stream(
    client: httpx.AsyncClient,
    item: WorkItem,
    payload: dict[str, Any],
    record: RequestRecord,
    sent: float,
    clock: Callable[[], float],
) -> None:
    async with client.stream("POST", item.path, json=payload) as response:
        record.status = response.status_code
        if response.status_code != 200:
            record.error = f"HTTP {response.status_code}: {error_message(await response.aread())}"
            return
        parser = SSEParser()
        timer = StreamTimer(record, sent)
        async for chunk in response.aiter_bytes():
            now = clock()
            for event in parser.feed(chunk):
                timer.on_event(event, now)
        for event in parser.close():
            timer.on_event(event, clock())
        timer.finish()


async def _whole(
    client: httpx.AsyncClient,
    item: WorkItem,
    payload: dict[str, Any],
    record: RequestRecord,
    sent: float,
    clock: Callable[[], float],
) -> None:
    response = await client.post(item.path, json=payload)
    now = clock()
    record.status = response.status_code
    if response.status_code != 200:
        record.error = f"HTTP {response.status_code}: {error_message(response.content)}"
        return
    data = response.json()
    # Without streaming the first token is seen with the last, as in vLLM's benchmark.
    record.ttft = record.e2el = now - sent
    usage = data.get("usage") or {}
    record.prompt_tokens = usage.get("prompt_tokens")
    record.cached_tokens = cached_tokens(usage)
    if usage.get("completion_tokens") is None:
        raise StreamError("response has no usage.completion_tokens")
    record.output_tokens = int(usage["completion_tokens"])
    choice = (data.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    record.text = choice.get("text") or (message.get("content") or "") + calls_text(message)
    if isinstance(data.get("speculation"), dict):
        record.speculation = data["speculation"]
    record.success = True


def cached_tokens(usage: dict[str, Any]) -> int | None:
    """usage.prompt_tokens_details.cached_tokens, where the server reports it."""
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict) or details.get("cached_tokens") is None:
        return None
    return int(details["cached_tokens"])
