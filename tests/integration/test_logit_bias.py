"""logit_bias with speculation on, on the real engine, through the official client.

The target drafting for itself makes the check sharp: every draft it proposes is its own
unbiased choice and would be accepted, so if a draft ever reached a biased request the
banned token would come back. Greedy float32 output must equal the server's without
speculation, and an unbiased neighbour's output must not change while it keeps verifying
drafts in the steps it shares with the biased request.
"""

import asyncio
from typing import Any

import openai
import pytest

from tests.integration.conftest import RunningServer
from tests.integration.test_openai_client import client_for

pytestmark = pytest.mark.integration

PROMPT = "def fibonacci(n):"
NEIGHBOUR_PROMPT = "The quick brown fox"
MAX_TOKENS = 24


def token_id(server: RunningServer, text: str) -> int:
    """The one vocabulary id that decodes to `text`: with it unique, a token string missing
    from the logprobs means the id is missing from the output."""
    engine = server.engine
    ids = [t for t in range(engine.info().vocab_size) if engine.decode([t]) == text]
    assert len(ids) == 1, (text, ids)
    return ids[0]


async def complete(
    server: RunningServer, prompt: str, max_tokens: int = MAX_TOKENS, **extra: Any
) -> Any:
    return await client_for(server).completions.create(
        model=server.model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=0,
        **extra,
    )


def tokens(result: Any) -> list[str]:
    logprobs = result.choices[0].logprobs
    assert logprobs is not None
    return list(logprobs.tokens)


def speculation(result: Any) -> dict[str, Any]:
    return dict((result.model_extra or {})["speculation"])


async def test_a_banned_token_never_appears_and_a_forced_one_fills_the_reply(
    self_draft_server: RunningServer, plain_server: RunningServer
) -> None:
    unbiased = await complete(self_draft_server, PROMPT)
    assert speculation(unbiased)["accepted_tokens"] > 0  # speculation is on
    first = tokens(unbiased)[0]
    banned = token_id(self_draft_server, first)

    ban = {"logit_bias": {str(banned): -100}}
    biased = await complete(self_draft_server, PROMPT, **ban)
    reply = tokens(biased)
    assert reply[0] != first
    assert first not in reply, reply
    summary = speculation(biased)
    assert (summary["applied"], summary["reason"]) == (False, "logit_bias"), summary
    reference = await complete(plain_server, PROMPT, **ban)
    assert biased.choices[0].text == reference.choices[0].text

    forced_text = next(t for t in reply if t != first and t.strip())
    forced = token_id(self_draft_server, forced_text)
    force = {"logit_bias": {str(forced): 100}}
    biased = await complete(self_draft_server, PROMPT, **force)
    assert tokens(biased) == [forced_text] * MAX_TOKENS
    reference = await complete(plain_server, PROMPT, **force)
    assert biased.choices[0].text == reference.choices[0].text


async def test_chat_honours_a_ban_like_the_server_without_speculation(
    self_draft_server: RunningServer, plain_server: RunningServer
) -> None:
    async def chat(server: RunningServer, **extra: Any) -> Any:
        return await client_for(server).chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": "Write a function."}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            logprobs=True,
            **extra,
        )

    def chat_tokens(result: Any) -> list[str]:
        return [entry.token for entry in result.choices[0].logprobs.content]

    first = chat_tokens(await chat(self_draft_server))[0]
    ban = {"logit_bias": {str(token_id(self_draft_server, first)): -100}}
    biased = await chat(self_draft_server, **ban)
    assert first not in chat_tokens(biased)
    assert speculation(biased)["reason"] == "logit_bias"
    reference = await chat(plain_server, **ban)
    assert biased.choices[0].message.content == reference.choices[0].message.content


async def test_an_unbiased_neighbour_says_the_same_beside_a_biased_request(
    self_draft_server: RunningServer,
) -> None:
    alone = await complete(self_draft_server, NEIGHBOUR_PROMPT)
    idle_alone = speculation(alone)["steps_by_k"].get("0", 0)
    first = tokens(await complete(self_draft_server, PROMPT))[0]
    ban = {"logit_bias": {str(token_id(self_draft_server, first)): -100}}
    biased_alone = await complete(self_draft_server, PROMPT, **ban)

    # The biased request outlasts its neighbour, so every step of the neighbour has it beside.
    biased, neighbour = await asyncio.gather(
        complete(self_draft_server, PROMPT, **ban, max_tokens=2 * MAX_TOKENS),
        complete(self_draft_server, NEIGHBOUR_PROMPT),
    )
    assert neighbour.choices[0].text == alone.choices[0].text
    # The bias stopped the biased request's drafts alone: the neighbour drafted as it does
    # alone (fixed K), every draft accepted, while every token of the biased one kept the bias.
    summary = speculation(neighbour)
    assert summary["drafts"] > 0, summary
    assert summary["steps_by_k"].get("0", 0) <= idle_alone, summary
    assert summary["accepted_tokens"] == summary["draft_tokens"], summary
    assert biased.choices[0].text.startswith(biased_alone.choices[0].text)
    assert first not in tokens(biased)
    summary = speculation(biased)
    assert (summary["drafts"], summary["reason"]) == (0, "logit_bias"), summary


async def test_an_invalid_logit_bias_is_a_400_naming_it(
    self_draft_server: RunningServer,
) -> None:
    vocab_size = self_draft_server.engine.info().vocab_size
    for bias in ({str(vocab_size): -100}, {"1": 101}, {"x": 1}):
        with pytest.raises(openai.BadRequestError) as caught:
            await complete(self_draft_server, PROMPT, logit_bias=bias, stream=True)
        assert caught.value.param == "logit_bias", caught.value


async def test_a_bias_of_zeros_leaves_a_neighbour_s_drafts_verified(
    self_draft_server: RunningServer,
) -> None:
    no_op = {"logit_bias": {"0": 0}}  # a bias that changes nothing is no bias
    zeros, plain = await asyncio.gather(
        complete(self_draft_server, PROMPT, **no_op, max_tokens=2 * MAX_TOKENS),
        complete(self_draft_server, NEIGHBOUR_PROMPT),
    )
    for result in (plain, zeros):
        summary = speculation(result)
        assert summary["applied"] and summary["drafts"] > 0, summary
        assert summary["accepted_tokens"] == summary["draft_tokens"], summary
