"""The memory report on the real engine: `specserve serve` on the tiny pair says in its startup
line and /health what its processes hold, and that adds up to what the OS reports for them;
requests prepared together take turns with the tokenizer, so its pool of copies does not grow."""

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from safetensors import safe_open

from server.autopilot.suffix_tree import BYTES_PER_TOKEN
from tests.integration.conftest import RunningServer, TinyModels, serving

pytestmark = pytest.mark.integration


def _checkpoint_bytes(folder: Path) -> int:
    """The checkpoint's tensors as torch loads them (float32 tiny models, served in float32)."""
    total = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as file:
            total += sum(file.get_tensor(name).nbytes for name in file.keys())  # noqa: SIM118
    return total


def test_the_report_adds_up_to_what_the_os_reports(tiny: TinyModels, tmp_path: Path) -> None:
    # Unquantized, so the weights served are the checkpoints themselves.
    flags = ("--quantization", "none", "--draft-quantization", "none")
    flags += ("--max-num-seqs", "4", "--lookup-index-tokens", "1000")
    with serving(tiny, tmp_path, *flags) as server:
        memory = httpx.get(f"{server.base_url}/health").json()["details"]["memory"]
        root = psutil.Process(server.popen.pid)
        processes = [root, *root.children(recursive=True)]
        measured = sum(process.memory_full_info().uss for process in processes)
        log = server.log.read_text()
    assert abs(memory["held_bytes"] - measured) <= 0.1 * measured, (memory, measured)
    assert sum(memory["processes_bytes"].values()) == memory["held_bytes"]
    names = list(memory["processes_bytes"])
    assert names[0] == "front end" and any(name.startswith("EngineCore") for name in names)
    # One rank runs in the EngineCore's process, not in a worker process of its own.
    assert not any(name.startswith("Worker") for name in names), names
    assert memory["weights_bytes"] == {
        "target": _checkpoint_bytes(tiny.target),
        "draft": _checkpoint_bytes(tiny.close_draft),
    }
    assert memory["kv_cache_bytes"] == 2**30  # the tiny server's --kv-cache-gib 1
    planned = sum(memory["weights_bytes"].values()) + memory["kv_cache_bytes"]
    assert memory["held_over_planned"] == round(memory["held_bytes"] / planned, 3)
    assert "memory: " in log and " GB planned (weights as served: target " in log
    # Hybrid: the reply trees and four requests' trees of the whole 2048-token context.
    assert memory["lookup_trees_bound_bytes"] == (1000 + 4 * 2048) * BYTES_PER_TOKEN
    assert "; lookup trees up to 0.00 more" in log


def test_a_kv_cache_the_host_cannot_hold_is_made_to_fit(tiny: TinyModels, tmp_path: Path) -> None:
    """Without the fit, vLLM's worker refuses a KV cache larger than the free memory and
    the engine dies at startup; with it the server starts and says what it chose."""
    beyond = psutil.virtual_memory().total // 2**30 + 8
    with serving(tiny, tmp_path, "--kv-cache-gib", str(beyond)) as server:
        memory = httpx.get(f"{server.base_url}/health").json()["details"]["memory"]
        log = server.log.read_text()
    fitted = memory["kv_cache_bytes"] // 2**30
    assert 1 <= fitted < beyond
    assert f"KV cache {fitted} GiB instead of {beyond} (max model len 2048): this host has " in log


class _CountedTokenizer:
    """The engine's tokenizer, counting the threads inside its calls at once."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._count = threading.Lock()
        self.inside = 0
        self.most_inside = 0
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._tokenizer, name)
        if name not in ("encode", "decode", "apply_chat_template"):
            return attribute
        return self._counted(attribute)

    def _counted(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            with self._count:
                self.calls += 1
                self.inside += 1
                self.most_inside = max(self.most_inside, self.inside)
            try:
                # Holds the call open, so that threads calling together would be inside at once.
                time.sleep(0.05)
                return call(*args, **kwargs)
            finally:
                with self._count:
                    self.inside -= 1

        return counted


async def test_requests_prepared_together_take_turns_with_the_tokenizer(
    spec_server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's tokenizer gives each thread inside it at once a copy of its own and keeps it;
    requests are prepared on asyncio's executor threads (six on two cores)."""
    counted = _CountedTokenizer(spec_server.engine._tokenizer)
    monkeypatch.setattr(spec_server.engine, "_tokenizer", counted)

    async def chat(client: httpx.AsyncClient, index: int) -> int:
        body = {
            "model": spec_server.model,
            "messages": [{"role": "user", "content": f"request {index}: hello"}],
            "max_tokens": 2,
        }
        response = await client.post("/v1/chat/completions", json=body)
        return response.status_code

    async with httpx.AsyncClient(base_url=spec_server.base_url, timeout=120) as client:
        statuses = await asyncio.gather(*(chat(client, index) for index in range(8)))
    assert statuses == [200] * 8
    assert counted.calls >= 8
    assert counted.most_inside == 1
