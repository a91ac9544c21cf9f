"""The memory report on the real engine: `specserve serve` on the tiny pair says in its startup
line and /health what its processes hold, and that adds up to what the OS reports for them."""

from pathlib import Path

import httpx
import psutil
import pytest
from safetensors import safe_open

from server.autopilot.suffix_tree import BYTES_PER_TOKEN
from tests.integration.conftest import TinyModels, serving

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
