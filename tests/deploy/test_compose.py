"""docker-compose.yml: the real compose v2 binary resolves it, and the resolved
services fit together (specserve with its model volume and drain time,
Prometheus on the project's scrape config and rules, Grafana provisioned with
the project's datasource and dashboard, the GPU variant behind a profile)."""

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


def test_default_up_is_cpu_prometheus_grafana() -> None:
    services = compose_config()["services"]
    assert set(services) == {"specserve", "prometheus", "grafana"}
    assert services["specserve"]["build"]["target"] == "cpu"


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
    (job,) = prometheus["scrape_configs"]
    assert job["static_configs"][0]["targets"] == [
        f"specserve:{Settings.model_fields['metrics_port'].default}"
    ]
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
