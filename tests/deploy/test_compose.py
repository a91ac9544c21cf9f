"""docker-compose.yml: the real compose v2 binary resolves it, and the resolved
services fit together (specserve with its model volume and drain time,
Prometheus on the project's scrape config and rules, Grafana provisioned with
the project's datasource and dashboard, the GPU variant behind a profile, two
replicas behind vLLM's router with Redis for their rate limits behind another)."""

import json
import re
import subprocess
from typing import Any

import pytest
import yaml

from server.config import Settings
from tests.deploy.conftest import ROOT, tool

pytestmark = pytest.mark.deploy


def compose_config(*args: str) -> dict[str, Any]:
    result = subprocess.run(
        [tool("docker-compose"), *args, "config", "--format", "json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    config: dict[str, Any] = json.loads(result.stdout)
    return config


def seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"([\d.]+)(ms|s|m|h)", duration))


REPLICAS = ("replica-a", "replica-b")
API_PORT = Settings.model_fields["port"].default
METRICS_PORT = Settings.model_fields["metrics_port"].default


def scrape_jobs() -> dict[str, dict[str, Any]]:
    prometheus = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    return {job["job_name"]: job for job in prometheus["scrape_configs"]}


def flag_values(command: list[str], flag: str) -> list[str]:
    """The arguments after `flag` up to the next flag."""
    assert command.count(flag) == 1, f"{flag} in {command}"
    rest = command[command.index(flag) + 1 :]
    end = next((i for i, arg in enumerate(rest) if arg.startswith("--")), len(rest))
    return rest[:end]


def flag_value(command: list[str], flag: str) -> str:
    (value,) = flag_values(command, flag)
    return value


def test_default_up_is_cpu_prometheus_grafana() -> None:
    services = compose_config()["services"]
    assert set(services) == {"specserve", "prometheus", "grafana"}
    assert services["specserve"]["build"]["target"] == "cpu"


def test_replicas_profile_adds_two_replicas_redis_and_the_router() -> None:
    services = compose_config("--profile", "replicas")["services"]
    assert set(services) == {"specserve", "prometheus", "grafana", *REPLICAS, "redis", "router"}
    for name in (*REPLICAS, "redis", "router"):
        assert services[name]["profiles"] == ["replicas"], name


@pytest.mark.parametrize("name", REPLICAS)
def test_replica_is_the_cpu_server_unpublished_on_the_shared_store(name: str) -> None:
    config = compose_config("--profile", "replicas")
    replica = config["services"][name]
    assert replica["build"]["target"] == "cpu" and replica["image"] == "specserve:cpu"
    # The router is the entry: a replica's (open) port is not published on the host.
    assert not replica.get("ports")
    # One DNS name for all of them, which Prometheus discovers.
    assert "replica" in replica["networks"]["default"]["aliases"]
    env = replica["environment"]
    assert env["SPECSERVE_RATE_LIMIT_STORE"] == "redis://redis:6379/0"
    assert env["SPECSERVE_ALLOW_UNAUTHENTICATED"] == "true"
    # Every variable is a server setting, and its value passes the setting's validation.
    fields = {key.removeprefix("SPECSERVE_").lower(): value for key, value in env.items()}
    assert fields.keys() <= Settings.model_fields.keys(), fields.keys() - Settings.model_fields
    settings = Settings(**fields)
    assert settings.rate_limit_store == "redis://redis:6379/0"
    # The same model cache as the single server, and the drain time.
    (models,) = [v for v in replica["volumes"] if v["target"] == "/models"]
    assert models["type"] == "volume" and models["source"] == "models"
    assert models["source"] in config["volumes"]
    drain = Settings.model_fields["drain_timeout_seconds"].default
    assert seconds(replica["stop_grace_period"]) > drain
    assert "redis" in replica["depends_on"]
    # Healthy means ready (models loaded), as the router checks it.
    test = " ".join(replica["healthcheck"]["test"])
    assert test.startswith("CMD python3 ") and "/ready'" in test


def test_replicas_pull_the_shared_models_one_after_the_other() -> None:
    """Both write the one `models` volume: the second starts once the first is ready,
    with the models pulled, so two pulls never replace each other's folder."""
    services = compose_config("--profile", "replicas")["services"]
    assert services["replica-b"]["depends_on"]["replica-a"]["condition"] == "service_healthy"
    assert "replica-b" not in services["replica-a"].get("depends_on", {})


def test_redis_is_the_charts_pinned_image_and_unpublished() -> None:
    redis = compose_config("--profile", "replicas")["services"]["redis"]
    values = yaml.safe_load((ROOT / "helm/specserve/values.yaml").read_text())["redis"]
    assert redis["image"] == f"{values['image']['repository']}:{values['image']['tag']}"
    assert not redis.get("ports")
    command = redis["command"]
    assert flag_values(command, "--save") == [""], "no persistence, as in the chart"
    assert flag_value(command, "--maxmemory") == values["maxMemory"]


def test_router_routes_to_both_replicas_checked_on_ready_and_publishes_on_loopback() -> None:
    services = compose_config("--profile", "replicas")["services"]
    router = services["router"]
    assert router["build"]["target"] == "router" and router["image"] == "specserve:router"
    command = router["command"]
    assert flag_values(command, "--worker-urls") == [
        f"http://{name}:{API_PORT}" for name in REPLICAS
    ]
    assert flag_value(command, "--health-check-endpoint") == "/ready"
    assert flag_value(command, "--policy") == "cache_aware"
    # Listens on every interface (the router's default is loopback, unreachable from
    # the host's published port and from Prometheus).
    assert flag_value(command, "--host") == "0.0.0.0"
    assert flag_value(command, "--prometheus-host") == "0.0.0.0"
    # The first start pulls the models (minutes): the router waits long enough.
    assert int(flag_value(command, "--worker-startup-timeout-secs")) >= 1800
    (port,) = router["ports"]
    assert port["host_ip"] == "127.0.0.1"
    assert port["target"] == int(flag_value(command, "--port"))
    # Beside the single server's port, not on it.
    published = {p["published"] for p in services["specserve"]["ports"]}
    assert port["published"] not in published
    assert set(router["depends_on"]) == {*REPLICAS, "redis"}


def test_prometheus_discovers_the_replicas_and_the_router_by_dns() -> None:
    """By DNS, so that without the profile the names do not resolve and the jobs have no
    targets, rather than targets that are down."""
    services = compose_config("--profile", "replicas")["services"]
    jobs = scrape_jobs()
    discovered = {}
    for name, job in jobs.items():
        if "dns_sd_configs" in job:
            assert "static_configs" not in job, name
            (sd,) = job["dns_sd_configs"]
            assert sd["type"] == "A" and len(sd["names"]) == 1, name
            discovered[sd["names"][0]] = (name, sd["port"])
    aliases = {
        alias for name in REPLICAS for alias in services[name]["networks"]["default"]["aliases"]
    }
    replicas_job, replicas_port = discovered.pop("replica")
    assert "replica" in aliases and replicas_port == METRICS_PORT
    # The replicas count as job "specserve", as the rules' SpecserveDown and the chart do.
    assert {"target_label": "job", "replacement": "specserve"} in jobs[replicas_job][
        "relabel_configs"
    ]
    rules = (ROOT / "deploy/prometheus/rules.yml").read_text()
    assert 'up{job="specserve"}' in rules
    _, router_port = discovered.pop("router")
    assert router_port == int(flag_value(services["router"]["command"], "--prometheus-port"))
    assert not discovered


def test_gpu_profile_adds_the_gpu_variant_under_the_scraped_name() -> None:
    gpu = compose_config("--profile", "gpu")["services"]["specserve-gpu"]
    assert gpu["build"]["target"] == "gpu"
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert "specserve" in gpu["networks"]["default"]["aliases"]


@pytest.mark.parametrize("service", ["specserve", "specserve-gpu"])
def test_specserve_keeps_models_on_a_volume_and_drains(service: str) -> None:
    config = compose_config("--profile", "gpu")
    specserve = config["services"][service]
    (models,) = [v for v in specserve["volumes"] if v["target"] == "/models"]
    assert models["type"] == "volume" and models["source"] in config["volumes"]
    drain = Settings.model_fields["drain_timeout_seconds"].default
    assert seconds(specserve["stop_grace_period"]) > drain
    assert specserve["build"]["args"]["BASE_IMAGE"] == "debian:bookworm-slim"
    assert specserve["shm_size"]
    (port,) = specserve["ports"]
    assert port["target"] == Settings.model_fields["port"].default
    # Open access only because the published port is the host's loopback.
    assert port["host_ip"] == "127.0.0.1"
    assert specserve["environment"]["SPECSERVE_ALLOW_UNAUTHENTICATED"] == "true"


def test_bind_mounts_exist_and_prometheus_uses_the_project_config() -> None:
    services = compose_config()["services"]
    for name, service in services.items():
        for volume in service.get("volumes", []):
            if volume["type"] == "bind":
                assert (ROOT / volume["source"]).exists(), f"{name}: {volume['source']}"
    mounts = {v["target"]: v["source"] for v in services["prometheus"]["volumes"]}
    for name in ("prometheus.yml", "rules.yml"):
        assert mounts[f"/etc/prometheus/{name}"] == str(ROOT / "deploy" / "prometheus" / name)
    prometheus = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    # The single server's job first (tests/integration/test_prometheus.py points it at its
    # own server); the others discover the replicas profile.
    job = prometheus["scrape_configs"][0]
    assert job["job_name"] == "specserve"
    assert job["static_configs"] == [{"targets": [f"specserve:{METRICS_PORT}"]}]
    assert prometheus["rule_files"] == ["rules.yml"]


def test_grafana_is_provisioned_with_the_project_datasource_and_dashboard() -> None:
    grafana = compose_config()["services"]["grafana"]
    mounts = {v["target"]: v["source"] for v in grafana["volumes"]}
    assert mounts["/etc/grafana/provisioning"] == str(ROOT / "deploy/grafana/provisioning")
    provider = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/dashboards/specserve.yml").read_text()
    )["providers"][0]
    assert mounts[provider["options"]["path"]] == str(ROOT / "deploy/grafana/dashboards")
    datasource = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text()
    )["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090"
    assert "prometheus" in grafana["depends_on"]


def test_example_env_file_names_only_server_settings() -> None:
    fields = {f"SPECSERVE_{name.upper()}" for name in Settings.model_fields}
    example = (ROOT / "specserve.env.example").read_text()
    names = re.findall(r"^#? ?(SPECSERVE_[A-Z_]+)=", example, re.MULTILINE)
    assert names and set(names) <= fields, set(names) - fields
