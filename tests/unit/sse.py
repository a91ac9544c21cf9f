"""Parse an SSE body into its data payloads, for assertions."""

import json
from typing import Any


def events(body: str) -> list[Any]:
    """JSON payloads of every `data:` event; the final [DONE] as the string itself."""
    assert body.endswith("data: [DONE]\n\n"), body[-200:]
    payloads: list[Any] = []
    for block in body.strip().split("\n\n"):
        assert block.startswith("data: "), block
        data = block.removeprefix("data: ")
        payloads.append(data if data == "[DONE]" else json.loads(data))
    return payloads
