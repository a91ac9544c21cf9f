"""Build the CPU image for real and serve a completion from it (`make image-test`).

Steps, each timed: start a Docker engine if none runs (and stop it again at
the end), make a Debian base image with debootstrap when no registry is
reachable (deploy/docker/make-base-image.sh), `docker build --target cpu`,
then run the image on a tiny generated model (used as its own draft, so
speculation runs too), wait for /health and the image's HEALTHCHECK to turn
healthy, send one completion, and stop the container within its drain time.
Then `docker build --target router` and the compose profile `replicas` in
containers: two CPU containers named as compose names the replicas, on one
network, and the router image with the compose file's own router command;
once the router takes both as healthy, one chat completion through it.
Prints the build time, the image size, the startup time and how long a rebuild takes
after a one-line change to server/ (from a copy of the build context).

Too slow for every CI run (a cold build downloads ~2 GB of wheels); run it
after changing the Dockerfile, its base or the dependencies.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.tiny_models import build_model  # noqa: E402

CONTAINER = "specserve-image-test"
HOST_PORT = 18000
ROUTER_HOST_PORT = 18080
NETWORK = "specserve-image-test"
WHEELHOUSE = ROOT / "deploy" / "docker" / "wheels"


def run(
    *args: str, capture: bool = False, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    print("+", " ".join(args), flush=True)
    return subprocess.run(args, check=True, text=True, capture_output=capture, env=env)


def docker_ok() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True).returncode == 0


def start_dockerd(log: Path) -> subprocess.Popen[bytes]:
    """A private engine for this run; the caller stops it, so it never lingers."""
    with log.open("wb") as out:
        daemon = subprocess.Popen(["dockerd"], stdout=out, stderr=subprocess.STDOUT)
    for _ in range(60):
        if docker_ok():
            return daemon
        time.sleep(1)
    daemon.terminate()
    raise SystemExit(f"dockerd did not start; see {log}")


def stage_local_wheels() -> bool:
    """Copy pip's local find-links wheels into the build context; True if torch is among them.

    torch==2.13.0+cpu is not on PyPI; a host that has it locally (PIP_FIND_LINKS)
    builds without reaching the torch index."""
    found_torch = False
    for entry in os.environ.get("PIP_FIND_LINKS", "").split():
        folder = Path(entry.removeprefix("file://"))
        for wheel in folder.glob("*.whl") if folder.is_dir() else []:
            target = WHEELHOUSE / wheel.name
            if not target.exists():
                shutil.copy2(wheel, target)
            found_torch |= wheel.name.startswith("torch-")
    return found_torch


def get(path: str, timeout: float = 5) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{HOST_PORT}{path}", timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def wait_for(what: str, check: Callable[[], bool], limit: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < limit:
        try:
            if check():
                return time.monotonic() - start
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if not container_running():
            raise SystemExit(f"container exited while waiting for {what}")
        time.sleep(2)
    raise SystemExit(f"{what} not reached in {limit:.0f} s")


def container_running() -> bool:
    out = subprocess.run(
        ["docker", "inspect", "--format", "{{.State.Running}}", CONTAINER],
        capture_output=True,
        text=True,
    )
    return out.stdout.strip() == "true"


def health_status() -> str:
    return run(
        "docker", "inspect", "--format", "{{.State.Health.Status}}", CONTAINER, capture=True
    ).stdout.strip()


def complete() -> dict[str, object]:
    body = json.dumps({"model": "tiny", "prompt": "hello world", "max_tokens": 8}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{HOST_PORT}/v1/completions",
        data=body,
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        result: dict[str, object] = json.loads(response.read())
        return result


def router_over_two_replicas(build: list[str], cpu_tag: str, model: Path) -> float:
    """Build the router image, run it with docker-compose.yml's router command over two
    containers of `cpu_tag` named as the compose replicas, and send one chat completion
    through it; returns the seconds from starting the containers to both replicas healthy
    in the router's eyes."""
    router_tag = f"{cpu_tag.split(':')[0]}:router"
    run(*build[:2], "--target", "router", *build[4:], "-t", router_tag, str(ROOT),
        env={**os.environ, "DOCKER_BUILDKIT": "0"})  # fmt: skip
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    command = [str(arg) for arg in compose["services"]["router"]["command"]]
    replicas = ["replica-a", "replica-b"]
    run("docker", "network", "create", NETWORK, capture=True)
    try:
        started = time.monotonic()
        for name in replicas:
            run(
                "docker", "run", "-d", "--name", name, "--network", NETWORK, "--shm-size", "1g",
                "-v", f"{model}:/srv/tiny:ro", "-e", "SPECSERVE_ALLOW_UNAUTHENTICATED=true",
                cpu_tag, "serve", "--model", "/srv/tiny", "--draft-model", "/srv/tiny",
                "--served-model-name", "tiny", "--dtype", "float32", "--kv-cache-gib", "1",
                "--max-model-len", "512",
            )  # fmt: skip
        run(
            "docker", "run", "-d", "--name", "router", "--network", NETWORK,
            "-p", f"127.0.0.1:{ROUTER_HOST_PORT}:8000", router_tag, *command,
        )  # fmt: skip
        base = f"http://127.0.0.1:{ROUTER_HOST_PORT}"

        def both_healthy() -> bool:
            with urllib.request.urlopen(f"{base}/workers", timeout=5) as response:
                workers = json.loads(response.read())["workers"]
            return len(workers) == 2 and all(w["is_healthy"] for w in workers)

        deadline = time.monotonic() + 900
        while not answers_true(both_healthy):
            if time.monotonic() > deadline:
                raise SystemExit("the router never took both replicas as healthy")
            time.sleep(2)
        healthy_after = time.monotonic() - started
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        request = urllib.request.Request(
            f"{base}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            reply = json.loads(response.read())
        assert reply["usage"]["completion_tokens"] == 4, reply
        print("chat through the router:", json.dumps(reply)[:300])
        return healthy_after
    except BaseException:
        for name in ("router", *replicas):
            subprocess.run(["docker", "logs", "--tail", "40", name])
        raise
    finally:
        subprocess.run(["docker", "rm", "-f", "router", *replicas], capture_output=True)
        subprocess.run(["docker", "network", "rm", NETWORK], capture_output=True)


def answers_true(check: Callable[[], bool]) -> bool:
    """`check()`, or False while what it asks does not answer yet."""
    try:
        return check()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def rebuild_after_a_code_change(build: list[str], work: Path, tag: str) -> float:
    """Seconds to rebuild the image (`build`: the command without its tag and context) from
    a copy of the context with one line added to server/__init__.py; checks the line is in
    the rebuilt image, then removes that image."""
    context = work / "context"
    context.mkdir()
    for name in ("Dockerfile", ".dockerignore", "pyproject.toml"):
        shutil.copy2(ROOT / name, context / name)
    shutil.copytree(
        ROOT / "server", context / "server", ignore=shutil.ignore_patterns("__pycache__")
    )
    # Hard links: the wheelhouse can hold torch (hundreds of MB).
    shutil.copytree(WHEELHOUSE, context / WHEELHOUSE.relative_to(ROOT), copy_function=os.link)
    marker = f"# image-test rebuild {time.time_ns()}"
    with (context / "server" / "__init__.py").open("a") as init:
        init.write(marker + "\n")
    started = time.monotonic()
    run(*build, "-t", tag, str(context), env={**os.environ, "DOCKER_BUILDKIT": "0"})
    seconds = time.monotonic() - started
    code = "import server, pathlib; print(pathlib.Path(server.__file__).read_text())"
    shown = run(
        "docker", "run", "--rm", "--entrypoint", "python3", tag, "-c", code, capture=True
    ).stdout  # fmt: skip
    assert marker in shown, shown
    run("docker", "image", "rm", tag, capture=True)
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", default="specserve:cpu")
    parser.add_argument("--base-image", default="specserve-base:bookworm")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="specserve-image-test."))
    daemon = None if docker_ok() else start_dockerd(work / "dockerd.log")
    try:
        started = time.monotonic()
        run(str(ROOT / "deploy" / "docker" / "make-base-image.sh"), args.base_image)
        base_seconds = time.monotonic() - started

        build = ["docker", "build", "--target", "cpu"]
        build += ["--build-arg", f"BASE_IMAGE={args.base_image}"]
        if stage_local_wheels():
            build += ["--build-arg", "PIP_EXTRA_INDEX_URL="]
        started = time.monotonic()
        # The classic builder: Debian's engine ships without buildx.
        run(*build, "-t", args.tag, str(ROOT), env={**os.environ, "DOCKER_BUILDKIT": "0"})
        build_seconds = time.monotonic() - started
        size = int(
            run(
                "docker", "image", "inspect", "--format", "{{.Size}}", args.tag, capture=True
            ).stdout
        )

        model = build_model(work / "tiny", seed=0)
        # Readable by the image's unprivileged user (safetensors writes 0600 files).
        for path in (work, model, *model.iterdir()):
            path.chmod(0o755 if path.is_dir() else 0o644)
        # Without a key file the image listens on every interface only when told to.
        refused = subprocess.run(
            ["docker", "run", "--rm", args.tag, "serve"], capture_output=True, text=True
        )
        assert refused.returncode == 2, refused
        assert "refusing to serve 0.0.0.0 without --api-key-file" in refused.stderr, refused
        subprocess.run(["docker", "rm", "-f", CONTAINER], capture_output=True)
        run(
            "docker", "run", "-d", "--name", CONTAINER, "--shm-size", "1g",
            "-p", f"127.0.0.1:{HOST_PORT}:8000", "-v", f"{model}:/srv/tiny:ro",
            "-e", "SPECSERVE_ALLOW_UNAUTHENTICATED=true",
            args.tag, "serve", "--model", "/srv/tiny", "--draft-model", "/srv/tiny",
            "--served-model-name", "tiny", "--dtype", "float32", "--kv-cache-gib", "1",
            "--max-model-len", "512",
        )  # fmt: skip
        try:
            # Seconds on an idle 2-core box; several minutes when other vLLM
            # servers share the cores (>300 s seen at a load average of 27).
            up = wait_for("/health 200", lambda: get("/health")[0] == 200, 900)
            healthy = wait_for("HEALTHCHECK healthy", lambda: health_status() == "healthy", 120)
            result = complete()
            choices = result["choices"]
            assert isinstance(choices, list) and choices[0]["text"], result
            usage = result["usage"]
            assert isinstance(usage, dict) and usage["completion_tokens"] == 8, result
            print("completion:", json.dumps(result)[:400])
            stop_started = time.monotonic()
            run("docker", "stop", "--time", "45", CONTAINER, capture=True)
            stop_seconds = time.monotonic() - stop_started
            exit_code = run(
                "docker", "inspect", "--format", "{{.State.ExitCode}}", CONTAINER, capture=True
            ).stdout.strip()
        except BaseException:
            subprocess.run(["docker", "logs", "--tail", "80", CONTAINER])
            raise
        finally:
            subprocess.run(["docker", "rm", "-f", CONTAINER], capture_output=True)
        router_seconds = router_over_two_replicas(build, args.tag, model)
        rebuild_seconds = rebuild_after_a_code_change(build, work, f"{args.tag}-rebuild")
        print(
            f"image-test passed: base {base_seconds:.0f} s, build {build_seconds:.0f} s, "
            f"image {args.tag} {size / 1e9:.2f} GB, /health after {up:.0f} s, "
            f"healthy {healthy:.0f} s later, stop {stop_seconds:.0f} s (exit code {exit_code}), "
            f"router over two replicas healthy after {router_seconds:.0f} s, "
            f"rebuild after a one-line change to server/ {rebuild_seconds:.0f} s"
        )
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait(timeout=60)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
