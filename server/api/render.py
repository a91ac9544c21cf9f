"""Route POST /v1/{chat/completions,completions,responses}/render: the prompt token ids a
request would be generated from, without generating.

vLLM's render contract, which vllm-router's `cache_aware` policy calls on every replica to
route by token prefix: the same body as the generation route, validated and rendered the
same way (chat template, tools, fill-in-the-middle), answered with `{"token_ids": [...]}`
(a list of them for completions, one per prompt). Nothing reaches the engine, so these
routes are outside admission and rate limits; API keys apply as on every route.
"""

import asyncio
from collections.abc import Callable
from typing import TypeVar

from fastapi import APIRouter, Request
from pydantic import BaseModel

from server.api.auth import tenant
from server.api.deps import EngineDep, LimitsDep
from server.api.instrumentation import arrival
from server.api.replies import error_responses
from server.engine.contract import Engine
from server.protocol.chat import ChatCompletionRequest
from server.protocol.completions import CompletionRequest
from server.protocol.limits import RequestLimits
from server.protocol.responses import CreateResponseRequest
from server.serving import chat, completions, responses
from server.serving.common import Caller

router = APIRouter()
# The generation routes' errors but those of admission (429) and deadlines (504): JSON only.
RENDER_ERRORS = error_responses(400, 401, 404, 413, 503)
Body = TypeVar("Body")
Prepared = TypeVar("Prepared")


class RenderedPrompt(BaseModel):
    token_ids: list[int]


async def _prepare(
    prepare: Callable[[Engine, Body, RequestLimits, Caller], Prepared],
    engine: Engine,
    body: Body,
    limits: RequestLimits,
    request: Request,
) -> Prepared:
    """The generation route's own preparation (validation, limits, rendering, tokenizing),
    off the event loop as there."""
    # Nothing is generated: no engine priority, no deadline.
    render = Caller(arrival(request), tenant(request), priority=0, deadline=None)
    return await asyncio.to_thread(prepare, engine, body, limits, render)


@router.post("/v1/chat/completions/render", response_model=RenderedPrompt, responses=RENDER_ERRORS)
async def render_chat_completion(
    body: ChatCompletionRequest, request: Request, engine: EngineDep, limits: LimitsDep
) -> RenderedPrompt:
    prepared = await _prepare(chat.prepare, engine, body, limits, request)
    return RenderedPrompt(token_ids=prepared.request.prompt_token_ids)


@router.post("/v1/completions/render", response_model=list[RenderedPrompt], responses=RENDER_ERRORS)
async def render_completion(
    body: CompletionRequest, request: Request, engine: EngineDep, limits: LimitsDep
) -> list[RenderedPrompt]:
    prepared = await _prepare(completions.prepare, engine, body, limits, request)
    return [RenderedPrompt(token_ids=r.prompt_token_ids) for r in prepared.requests]


@router.post("/v1/responses/render", response_model=RenderedPrompt, responses=RENDER_ERRORS)
async def render_response(
    body: CreateResponseRequest, request: Request, engine: EngineDep, limits: LimitsDep
) -> RenderedPrompt:
    prepared = await _prepare(responses.prepare, engine, body, limits, request)
    return RenderedPrompt(token_ids=prepared.request.prompt_token_ids)
