"""A scripted stand-in for the engine, for fast HTTP-layer tests only.

Each word of a prompt is one token; generation replays a fixed script of
words per choice (its i-th word is token i, which a logit_bias of -100
bans), honours max_tokens and stop strings, and records aborts. A prompt's
cached tokens are its longest common prefix with an earlier prompt of the
same tenant (a prefix cache of one-token blocks, one cache per tenant).
The integration tests run the same routes on the real vLLM engine.
"""

import asyncio
import json
import re
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from server.engine.contract import (
    ChoiceDelta,
    EngineInfo,
    EngineMode,
    EngineOutput,
    GenerationRequest,
    ParsedReply,
    SpeculationInfo,
    SpeculationStats,
    TokenLogprob,
    TokenTimes,
)
from server.errors import APIError, InvalidRequestError

# What every scripted sequence reports on its last output.
SCRIPTED_SPECULATION = SpeculationStats(
    drafts=2, draft_tokens=6, accepted_tokens=4, accepted_per_position=[2, 1, 1]
)


class ScriptedToolCallParser:
    """Calls as `<call>{"name": ..., "arguments": {...}}</call>`; while streaming it
    sends the text before the first call and leaves the calls to the end."""

    CALL = re.compile(r"<call>(.*?)</call>", re.DOTALL)

    def __init__(self) -> None:
        self.text = ""

    def parse(self, text: str) -> ParsedReply:
        calls = [json.loads(body) for body in self.CALL.findall(text)]
        if not calls:
            return ParsedReply(text or None, [])
        content = text[: text.index("<call>")]
        return ParsedReply(
            content or None, [(c["name"], json.dumps(c["arguments"])) for c in calls]
        )

    def feed(self, text: str, token_ids: list[int]) -> str:
        self.text += text
        return "" if "<call>" in self.text else text


class ScriptedEngine:
    def __init__(
        self,
        script: list[str] | None = None,
        max_model_len: int = 64,
        step_delay: float = 0.0,
        fail_after: int | None = None,
    ) -> None:
        self.script = script or ["Hello", " world", "!", " How", " are", " you", "?"]
        self.max_model_len = max_model_len
        self.step_delay = step_delay
        self.fail_after = fail_after
        self.healthy = True
        self.aborted: list[str] = []
        self.requests: list[GenerationRequest] = []
        self.unfinished = 0
        self.rendered_messages: list[dict[str, Any]] = []
        self.rendered_tools: list[dict[str, Any]] | None = None
        self.prompts: list[tuple[str | None, list[int]]] = []  # (tenant, prompt) seen
        self.speculation = SCRIPTED_SPECULATION  # what each sequence reports on its last output
        self.speculative_method = "draft_model"
        self.autopilot: dict[str, Any] | None = None  # autopilot_state()

    def info(self) -> EngineInfo:
        return EngineInfo(
            model_name="scripted",
            max_model_len=self.max_model_len,
            vocab_size=1000,
            created=1_700_000_000,
            speculation=SpeculationInfo(self.speculative_method, 3, 1),
            dtype="float32",
            dtype_reason="set by --dtype",
            mode=EngineMode("vllm", "v1", False, False, (), "scripted"),
        )

    def memory(self) -> dict[str, Any] | None:
        return None

    def autopilot_state(self) -> dict[str, Any] | None:
        return self.autopilot

    def tokenize(self, text: str) -> list[int]:
        return [len(word) for word in text.split()]

    def decode(self, token_ids: list[int]) -> str:
        return " ".join("x" * t for t in token_ids)

    def render_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        self.rendered_messages, self.rendered_tools = messages, tools
        return self.tokenize(" ".join(f"{m['role']}: {m['content']}" for m in messages))

    def tool_call_parser(self) -> ScriptedToolCallParser:
        return ScriptedToolCallParser()

    def render_fill_in_the_middle(self, prefix: str, suffix: str) -> list[int]:
        # Token 0 (no word has length 0) stands for each fill-in-the-middle marker.
        return [0, *self.tokenize(prefix), 0, *self.tokenize(suffix), 0]

    def validate(self, request: GenerationRequest) -> None:
        # vLLM refuses several greedy samples of one prompt.
        if request.sampling.n > 1 and request.sampling.temperature == 0:
            raise InvalidRequestError("n must be 1 when using greedy sampling")

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[EngineOutput, None]:
        """Per-step deltas; a request not streamed gets one output at the end with its
        first and last token times, as the vLLM adapter asks vLLM for it."""
        steps = self._steps(request)
        if request.stream:
            async with aclosing(steps):
                async for output in steps:
                    yield output
            return
        parts: dict[int, list[ChoiceDelta]] = {}
        first = last = 0.0
        cached = 0
        async with aclosing(steps):
            async for output in steps:
                cached = output.cached_tokens
                last = time.perf_counter()
                first = first or last
                for choice in output.choices:
                    parts.setdefault(choice.index, []).append(choice)
        choices = [_whole(deltas) for _, deltas in sorted(parts.items())]
        yield EngineOutput(len(request.prompt_token_ids), choices, TokenTimes(first, last), cached)

    def _cached_tokens(self, request: GenerationRequest) -> int:
        """The longest prefix shared with an earlier prompt of the tenant; like vLLM's, never the
        whole prompt (its last token is computed to sample the first output)."""
        prompt = request.prompt_token_ids
        shared = [
            next(
                (i for i, (a, b) in enumerate(zip(prompt, seen, strict=False)) if a != b),
                min(len(prompt), len(seen)),
            )
            for tenant, seen in self.prompts
            if tenant == request.tenant
        ]
        return min(max(shared, default=0), max(len(prompt) - 1, 0))

    async def _steps(self, request: GenerationRequest) -> AsyncGenerator[EngineOutput, None]:
        self.validate(request)
        self.requests.append(request)
        cached = self._cached_tokens(request)
        self.prompts.append((request.tenant, request.prompt_token_ids))
        self.unfinished += 1
        options = request.sampling
        texts = {i: "" for i in range(options.n)}
        finished_choices: set[int] = set()
        done = False
        # The script's words are tokens 1, 2, ...; a bias of -100 bans one.
        bias = options.logit_bias or {}
        tokens = [(i + 1, w) for i, w in enumerate(self.script) if bias.get(i + 1, 0.0) > -100]
        try:
            for step, (token_id, word) in enumerate(tokens):
                if self.fail_after is not None and step == self.fail_after:
                    raise APIError("scripted failure")
                if self.step_delay:
                    await asyncio.sleep(self.step_delay)
                choices = []
                for index in range(options.n):
                    if index in finished_choices:
                        continue
                    texts[index] += word
                    finish = None
                    text = word
                    hit = next((s for s in options.stop if s in texts[index]), None)
                    if hit is not None:
                        text = word[: word.index(hit)] if hit in word else ""
                        finish = "stop"
                    elif step + 1 >= options.max_tokens or step + 1 == len(tokens):
                        finish = "length" if step + 1 >= options.max_tokens else "stop"
                    logprobs = None
                    if options.logprobs is not None:
                        alternatives = [(word, -0.5), ("other", -1.5)][: options.logprobs]
                        logprobs = [TokenLogprob(word, -0.5, alternatives)]
                    speculation = self.speculation if finish is not None else None
                    choices.append(
                        ChoiceDelta(index, text, [token_id], logprobs, finish, speculation)
                    )
                    if finish is not None:
                        finished_choices.add(index)
                done = len(finished_choices) == options.n
                yield EngineOutput(len(request.prompt_token_ids), choices, cached_tokens=cached)
                if done:
                    return
        finally:
            self.unfinished -= 1
            # Like the vLLM adapter: a consumer leaving early aborts the request.
            if not done:
                self.aborted.append(request.request_id)

    def unfinished_requests(self) -> int:
        return self.unfinished

    async def check_health(self) -> bool:
        return self.healthy

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None


def _whole(deltas: list[ChoiceDelta]) -> ChoiceDelta:
    """One choice's deltas as the single output of a reply that is not streamed."""
    logprobs = [entry for d in deltas for entry in d.logprobs or ()]
    return ChoiceDelta(
        deltas[0].index,
        "".join(d.text for d in deltas),
        [token for d in deltas for token in d.token_ids],
        logprobs if deltas[0].logprobs is not None else None,
        deltas[-1].finish_reason,
        deltas[-1].speculation,
    )
