"""Fixtures for HTTP-layer unit tests: the real app over a scripted engine."""

from collections.abc import AsyncIterator

import httpx
import pytest

from server.app import create_app
from tests.unit.scripted_engine import ScriptedEngine


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine()


@pytest.fixture
async def client(engine: ScriptedEngine) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client
