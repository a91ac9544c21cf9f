"""How far the quantized targets (`--quantization int8`, `int4`) are from the unquantized one,
on the embedded target, in the dtype the server picks on this machine.

Each quantization (--quantizations, and none) runs vLLM's own `LLM` on its folder in a process
of its own, one after the other (a quantized copy is made first if it is not cached), loaded as
the server loads it on a CPU (int8: its output head in int8 too, and vLLM's int8 kernel as the
server picks it for the CPU):
- greedy continuations (--max-tokens) of the bundled coding-chat and prose prompts, through
  the chat template;
- the log-probability of every token of texts the project ships (docs/speculation.md as prose,
  server/autopilot/policy.py as code), each cut to --text-tokens, teacher-forced.

Prints, and writes to <out>/fidelity.md: per workload, the prompts whose continuations are
identical and the mean tokens before the first difference; per text, the mean log-probability
per token under each, their difference and the perplexity ratio (quantized over none).

    .venv/bin/python scripts/quantization_fidelity.py --out /work/fidelity
"""

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from loadtest.workloads import BUNDLED
from server.config import Settings
from server.engine.hardware import choose_dtype
from server.engine.resolve import prepare_target
from server.engine.runtime import configure_cpu_runtime
from server.vllm_plugins import patching
from server.weights import embedded

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ("coding-chat", "prose")
TEXTS = {
    "prose": ROOT / "docs" / "speculation.md",
    "code": ROOT / "server" / "autopilot" / "policy.py",
}
QUANTIZATIONS = ("none", "int8", "int4")


def _measure(folder: str, max_tokens: int, text_tokens: int) -> dict[str, Any]:
    """In this process: greedy token ids per workload prompt, prompt log-probs per text."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    configure_cpu_runtime(kv_cache_gib=2, ranks=1)
    llm = LLM(
        model=folder,
        dtype=choose_dtype("auto", on_gpu=False).dtype,
        max_model_len=4096,
        enforce_eager=True,
        seed=0,
    )
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    continuations = {}
    for workload in WORKLOADS:
        conversations = [
            [{"role": role, "content": content} for role, content in item.messages or ()]
            for item in BUNDLED[workload]
        ]
        outputs = llm.chat(conversations, greedy, use_tqdm=False)
        continuations[workload] = [list(output.outputs[0].token_ids) for output in outputs]
    tokenizer = llm.get_tokenizer()
    scoring = SamplingParams(max_tokens=1, prompt_logprobs=0)
    logprobs = {}
    for name, path in TEXTS.items():
        ids = tokenizer.encode(path.read_text())[:text_tokens]
        (output,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], scoring, use_tqdm=False)
        assert output.prompt_logprobs is not None
        logprobs[name] = [
            position[token].logprob
            for token, position in zip(ids[1:], output.prompt_logprobs[1:], strict=True)
            if position is not None
        ]
    return {"continuations": continuations, "logprobs": logprobs}


def _first_difference(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def _table(results: dict[str, dict[str, Any]], max_tokens: int) -> str:
    none = results["none"]
    quantized = [q for q in results if q != "none"]
    lines = [
        f"Greedy continuations of {max_tokens} tokens, each quantization against none:",
        "",
        "| workload | quantization | prompts identical | mean tokens before the first difference |",
        "|---|---|---|---|",
    ]
    for workload in WORKLOADS:
        for name in quantized:
            pairs = list(
                zip(
                    none["continuations"][workload],
                    results[name]["continuations"][workload],
                    strict=True,
                )
            )
            same = sum(a == b for a, b in pairs)
            before = sum(_first_difference(a, b) for a, b in pairs) / len(pairs)
            lines.append(f"| {workload} | {name} | {same} of {len(pairs)} | {before:.1f} |")
    lines += [
        "",
        "Teacher-forced log-probability per token of shipped texts:",
        "",
        "| text | tokens | quantization | none | quantized | difference | perplexity ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for text in TEXTS:
        for name in quantized:
            a, b = none["logprobs"][text], results[name]["logprobs"][text]
            mean_a, mean_b = sum(a) / len(a), sum(b) / len(b)
            lines.append(
                f"| {text} ({TEXTS[text].relative_to(ROOT)}) | {len(a)} | {name} | {mean_a:.4f} "
                f"| {mean_b:.4f} | {mean_b - mean_a:+.4f} | {math.exp(mean_a - mean_b):.4f} |"
            )
    return "\n".join(lines) + "\n"


def _run_worker(command: list[str], result: Path) -> None:
    """Run one worker to its result. vLLM's engine processes can hang at exit (seen once with
    the int8 copy: idle for minutes, holding 8 GB, after its results were written), so once
    the result is there the worker's process group gets a minute, then is killed."""
    result.unlink(missing_ok=True)
    worker = subprocess.Popen(command, start_new_session=True)
    while worker.poll() is None and not result.is_file():
        time.sleep(1)
    try:
        worker.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
    if not result.is_file():
        raise SystemExit(f"worker failed (exit code {worker.returncode}): {' '.join(command)}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("loadtest-results/fidelity"))
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--text-tokens", type=int, default=2048)
    parser.add_argument(
        "--quantizations", nargs="+", choices=QUANTIZATIONS[1:], default=QUANTIZATIONS[1:]
    )
    parser.add_argument("--worker", choices=QUANTIZATIONS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        settings = Settings(quantization=args.worker)
        target = embedded.pull(settings.cache_dir, embedded.TARGET)
        plan = prepare_target(settings, str(target))
        # As the server loads the target on a CPU: vocabulary-sized weights held once and,
        # for int8, the output head in int8 (server/vllm_plugins/cpu_memory.py).
        served = {"patches": ["cpu_embedding_memory"], "int8_head": plan.int8_head}
        os.environ[patching.SETTINGS_ENV] = json.dumps(served)
        result = _measure(plan.model, args.max_tokens, args.text_tokens)
        (args.out / f"{args.worker}.json").write_text(json.dumps(result))
        return
    (args.out / "lscpu.txt").write_text(subprocess.check_output(["lscpu"], text=True))
    measured = ["none", *args.quantizations]
    for quantization in measured:
        command = [sys.executable, __file__, "--worker", quantization, "--out", str(args.out)]
        command += ["--max-tokens", str(args.max_tokens), "--text-tokens", str(args.text_tokens)]
        print("$", " ".join(command), flush=True)
        _run_worker(command, args.out / f"{quantization}.json")
    results = {q: json.loads((args.out / f"{q}.json").read_text()) for q in measured}
    table = _table(results, args.max_tokens)
    (args.out / "fidelity.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
