"""helm/specserve: the real helm binary lints and renders it, every rendered
manifest validates against the Kubernetes schemas, and the rendered objects
say what the chart promises (probes, resources, secret wiring, optional
objects only when enabled, drain time, the project's rules and dashboard)."""

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from server.config import Settings
from server.traffic.api_keys import load_key_ring
from tests.deploy.conftest import (
    CHART,
    CI_VALUES,
    NAMESPACE,
    RELEASE,
    ROOT,
    Manifests,
    helm,
    kinds,
    only,
    tool,
)

pytestmark = pytest.mark.deploy

Render = Callable[..., Manifests]
FULLNAME = f"{RELEASE}-specserve"
# Custom resources: kubernetes-validate has no schema for them; their fields are
# checked by the assertions below (and the rules by promtool). The LeaderWorkerSet
# is validated strictly too (see validate_leaderworkerset).
CUSTOM_KINDS = {"ServiceMonitor", "PrometheusRule", "ScaledObject", "LeaderWorkerSet"}
LEADERWORKERSET_SCHEMA = json.loads(
    (Path(__file__).parent / "leaderworkerset-v1.schema.json").read_text()
)
# The chart's kubeVersion floor and the newest schemas kubernetes-validate has.
KUBERNETES_VERSIONS = ["1.27.0", kubernetes_validate.latest_version()]
DEFAULT_KINDS = {"Deployment", "Service", "ServiceAccount", "PersistentVolumeClaim"}
DEFAULT_KINDS |= {"PodDisruptionBudget"}
# Values passed to Kubernetes as they are; documented as one row each.
FREE_FORM_VALUES = {"resources", "podSecurityContext", "securityContext", "strategy", "labels"}


def ci_values(name: str) -> Path:
    path = CHART / "ci" / f"{name}-values.yaml"
    assert path in CI_VALUES
    return path


def deployment(manifests: Manifests, name: str = FULLNAME) -> dict[str, Any]:
    (found,) = [m for m in manifests if m["kind"] == "Deployment" and m["metadata"]["name"] == name]
    return found


def server_pod_template(manifests: Manifests) -> dict[str, Any]:
    """The pod that runs specserve: the Deployment's, or a multi-node replica's leader."""
    (workload,) = [
        m
        for m in manifests
        if m["kind"] in {"Deployment", "LeaderWorkerSet"} and m["metadata"]["name"] == FULLNAME
    ]
    template: dict[str, Any] = (
        workload["spec"]["template"]
        if workload["kind"] == "Deployment"
        else workload["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    )
    return template


def container(manifests: Manifests) -> dict[str, Any]:
    containers = server_pod_template(manifests)["spec"]["containers"]
    assert len(containers) == 1
    result: dict[str, Any] = containers[0]
    return result


def env(manifests: Manifests) -> dict[str, str]:
    return {item["name"]: item["value"] for item in container(manifests)["env"]}


def service(manifests: Manifests, name: str) -> dict[str, Any]:
    (found,) = [m for m in manifests if m["kind"] == "Service" and m["metadata"]["name"] == name]
    return found


def pod_spec(manifests: Manifests) -> dict[str, Any]:
    spec: dict[str, Any] = server_pod_template(manifests)["spec"]
    return spec


def test_ci_values_cover_cpu_gpu_multi_gpu_and_monitoring() -> None:
    names = {path.name.removesuffix("-values.yaml") for path in CI_VALUES}
    assert {"cpu", "gpu", "multi-gpu", "monitoring"} <= names


@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=lambda v: v.name if v else "default")
def test_helm_lint_strict(values: Path | None) -> None:
    args = ["lint", "--strict", str(CHART)] + (["--values", str(values)] if values else [])
    result = helm(*args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("values", CI_VALUES, ids=lambda v: v.name)
def test_every_manifest_validates_strictly(rendered: Render, values: Path, version: str) -> None:
    validate_strictly(rendered(values), version, values.name)


def validate_strictly(manifests: Manifests, version: str, context: str) -> None:
    for manifest in manifests:
        name = f"{manifest['kind']}/{manifest['metadata']['name']}"
        try:
            if manifest["kind"] == "LeaderWorkerSet":
                validate_leaderworkerset(manifest, version)
            kubernetes_validate.validate(manifest, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            assert manifest["kind"] in CUSTOM_KINDS, f"{name}: no schema for a core kind"
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{context}: {name} invalid for Kubernetes {version}: {exc}")


def validate_leaderworkerset(manifest: dict[str, Any], version: str) -> None:
    """Its own fields against the LWS v1 schema (unknown fields are errors), and its leader
    and worker pod templates strictly as the core PodTemplateSpecs they are."""
    jsonschema.validate(manifest, LEADERWORKERSET_SCHEMA)
    templates = manifest["spec"]["leaderWorkerTemplate"]
    for role in ("leaderTemplate", "workerTemplate"):
        pod_template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": f"{manifest['metadata']['name']}-{role.lower()}"},
            "template": templates[role],
        }
        kubernetes_validate.validate(pod_template, version, strict=True)


def test_defaults_render_only_the_core_objects(rendered: Render) -> None:
    assert kinds(rendered()) == DEFAULT_KINDS


@pytest.mark.parametrize(
    ("setting", "kind"),
    [
        ("autoscaling.enabled", "HorizontalPodAutoscaler"),
        ("keda.enabled", "ScaledObject"),
        ("metrics.serviceMonitor.enabled", "ServiceMonitor"),
        ("metrics.prometheusRule.enabled", "PrometheusRule"),
        ("metrics.grafanaDashboard.enabled", "ConfigMap"),
    ],
)
def test_optional_objects_appear_only_when_enabled(
    rendered: Render, setting: str, kind: str
) -> None:
    assert kind not in kinds(rendered())
    manifests = rendered(**{setting: "true"})
    assert kinds(manifests) == DEFAULT_KINDS | {kind}
    autoscaled = kind in {"HorizontalPodAutoscaler", "ScaledObject"}
    # An autoscaled Deployment leaves replicas to the autoscaler.
    assert ("replicas" in only(manifests, "Deployment")["spec"]) != autoscaled


@pytest.mark.parametrize(
    ("sets", "absent"),
    [
        ({"podDisruptionBudget.enabled": "false"}, "PodDisruptionBudget"),
        ({"serviceAccount.create": "false"}, "ServiceAccount"),
        ({"modelCache.type": "emptyDir"}, "PersistentVolumeClaim"),
        ({"modelCache.existingClaim": "shared-models"}, "PersistentVolumeClaim"),
    ],
)
def test_default_objects_can_be_turned_off(
    rendered: Render, sets: dict[str, str], absent: str
) -> None:
    assert kinds(rendered(**sets)) == DEFAULT_KINDS - {absent}


def test_probes_use_health_ready_and_give_startup_time_for_the_model(rendered: Render) -> None:
    main = container(rendered())
    assert main["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert main["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert main["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    startup = main["startupProbe"]
    # First start pulls and converts the embedded pair (~5 min) and loads it (~1 min).
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 15 * 60
    ports = {port["name"]: port["containerPort"] for port in main["ports"]}
    assert env(rendered())["SPECSERVE_PORT"] == str(ports["http"])
    assert env(rendered())["SPECSERVE_METRICS_PORT"] == str(ports["metrics"])
    pods = only(rendered(), "Deployment")["spec"]["selector"]["matchLabels"]
    # The API Service never exposes /metrics; a Service of its own does, in the cluster.
    api, metrics = service(rendered(), FULLNAME), service(rendered(), f"{FULLNAME}-metrics")
    assert [p["targetPort"] for p in api["spec"]["ports"]] == ["http"]
    assert [p["targetPort"] for p in metrics["spec"]["ports"]] == ["metrics"]
    assert metrics["spec"]["type"] == "ClusterIP"
    assert api["spec"]["selector"] == metrics["spec"]["selector"] == pods


@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=lambda v: v.name if v else "default")
def test_termination_grace_period_covers_the_drain(rendered: Render, values: Path | None) -> None:
    manifests = rendered(values) if values else rendered()
    drain = float(env(manifests)["SPECSERVE_DRAIN_TIMEOUT_SECONDS"])
    pre_stop = container(manifests)["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    grace = pod_spec(manifests)["terminationGracePeriodSeconds"]
    assert grace >= drain + float(pre_stop[1]) + 5


def test_drain_default_is_the_servers(rendered: Render) -> None:
    drain = float(env(rendered())["SPECSERVE_DRAIN_TIMEOUT_SECONDS"])
    assert drain == Settings.model_fields["drain_timeout_seconds"].default


def test_cpu_resources_and_no_gpu(rendered: Render) -> None:
    resources = container(rendered(ci_values("cpu")))["resources"]
    assert resources["requests"]["cpu"] and resources["requests"]["memory"]
    assert resources["limits"]["memory"]
    assert "nvidia.com/gpu" not in resources["limits"]
    assert container(rendered(ci_values("cpu")))["image"] == "specserve:0.1.0-cpu"


@pytest.mark.parametrize(("name", "gpus"), [("gpu", 1), ("multi-gpu", 4)])
def test_gpu_resources_scheduling_and_tensor_parallelism(
    rendered: Render, name: str, gpus: int
) -> None:
    manifests = rendered(ci_values(name))
    main = container(manifests)
    assert main["resources"]["limits"]["nvidia.com/gpu"] == gpus
    assert main["resources"]["limits"]["memory"], "the GPU limit must not replace the others"
    assert main["image"] == "specserve:0.1.0-gpu"
    spec = pod_spec(manifests)
    assert spec["nodeSelector"]
    assert {t["key"] for t in spec["tolerations"]} == {"nvidia.com/gpu"}
    tensor_parallel = env(manifests).get("SPECSERVE_TENSOR_PARALLEL_SIZE")
    assert tensor_parallel == (str(gpus) if gpus > 1 else None)


def test_multi_gpu_scales_on_queue_depth_of_its_own_pods(rendered: Render) -> None:
    manifests = rendered(ci_values("multi-gpu"))
    scaled = only(manifests, "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"]["name"] == FULLNAME
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    query = trigger["metadata"]["query"]
    assert query.startswith("sum(specserve_requests_queued{")
    assert f'namespace="{NAMESPACE}"' in query and f'service="{FULLNAME}-metrics"' in query
    assert "replicas" not in only(manifests, "Deployment")["spec"]


def test_chart_api_keys_secret_is_a_key_file_the_server_loads(
    rendered: Render, tmp_path: Path
) -> None:
    manifests = rendered(ci_values("cpu"))
    secret = only(manifests, "Secret")
    ((file_name, content),) = secret["stringData"].items()
    key_file = tmp_path / file_name
    key_file.write_text(content)
    assert load_key_ring(key_file).tenants == {"ci"}
    spec = pod_spec(manifests)
    (volume,) = [v for v in spec["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    (mount,) = [m for m in container(manifests)["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["readOnly"] is True
    assert env(manifests)["SPECSERVE_API_KEY_FILE"] == f"{mount['mountPath']}/{file_name}"
    assert "SPECSERVE_ALLOW_UNAUTHENTICATED" not in env(manifests)
    annotations = only(manifests, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert "checksum/api-keys" in annotations


def test_existing_api_keys_secret_is_mounted_not_created(rendered: Render) -> None:
    manifests = rendered(ci_values("gpu"))
    assert "Secret" not in kinds(manifests)
    (volume,) = [v for v in pod_spec(manifests)["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == "specserve-api-keys"
    assert "SPECSERVE_API_KEY_FILE" in env(manifests)


def test_gpu_pods_run_vllms_own_speculation_unless_the_engine_patches_are_asked_for(
    rendered: Render,
) -> None:
    assert "SPECSERVE_GPU_ENGINE_PATCHES" not in env(rendered(ci_values("gpu")))
    opted = rendered(ci_values("gpu"), **{"gpu.enginePatches": "true"})
    assert env(opted)["SPECSERVE_GPU_ENGINE_PATCHES"] == "true"
    # Meaningless without GPUs: a CPU pod always runs them, and is not told otherwise.
    assert "SPECSERVE_GPU_ENGINE_PATCHES" not in env(rendered(**{"gpu.enginePatches": "true"}))


def test_without_api_keys_nothing_secret_is_wired_and_open_access_is_explicit(
    rendered: Render,
) -> None:
    manifests = rendered()
    assert "Secret" not in kinds(manifests)
    assert "SPECSERVE_API_KEY_FILE" not in env(manifests)
    # The server refuses a non-loopback host without keys unless told open access is meant.
    assert env(manifests)["SPECSERVE_HOST"] == "0.0.0.0"
    assert env(manifests)["SPECSERVE_ALLOW_UNAUTHENTICATED"] == "true"
    assert not [v for v in pod_spec(manifests)["volumes"] if "secret" in v]


def test_the_chart_s_redis_holds_the_rate_limits_of_every_replica(rendered: Render) -> None:
    manifests = rendered(ci_values("shared-limits"))
    redis = deployment(manifests, f"{FULLNAME}-redis")
    redis_service = service(manifests, f"{FULLNAME}-redis")
    assert env(manifests)["SPECSERVE_RATE_LIMIT_STORE"] == f"redis://{FULLNAME}-redis:6379/0"
    assert env(manifests)["SPECSERVE_RATE_LIMIT_ON_STORE_FAILURE"] == "closed"
    (redis_container,) = redis["spec"]["template"]["spec"]["containers"]
    assert redis_container["image"] == "redis:7.4.2-alpine"
    assert redis_container["args"][-2:] == ["--maxmemory-policy", "volatile-ttl"]
    assert redis_service["spec"]["ports"][0]["port"] == 6379
    # Each selector picks its own pods only: the API never routes to Redis, nor Redis to the API.
    redis_pods = redis["spec"]["template"]["metadata"]["labels"]
    api_pods = deployment(manifests)["spec"]["template"]["metadata"]["labels"]
    for selector, pods, other in [
        (redis_service["spec"]["selector"], redis_pods, api_pods),
        (service(manifests, FULLNAME)["spec"]["selector"], api_pods, redis_pods),
        (only(manifests, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"], api_pods,
         redis_pods),
    ]:  # fmt: skip
        assert selector.items() <= pods.items()
        assert not selector.items() <= other.items()


def test_rate_limits_point_at_a_given_redis_or_stay_per_pod(rendered: Render) -> None:
    url = "redis://limits.example:6379/2"
    given = rendered(**{"rateLimits.store": url, "redis.enabled": "true"})
    assert env(given)["SPECSERVE_RATE_LIMIT_STORE"] == url
    assert env(given)["SPECSERVE_RATE_LIMIT_ON_STORE_FAILURE"] == "open"
    assert [m["metadata"]["name"] for m in given if m["kind"] == "Deployment"] == [FULLNAME]
    assert "SPECSERVE_RATE_LIMIT_STORE" not in env(rendered())


def test_model_cache_volume_per_type(rendered: Render) -> None:
    def models_volume(**sets: str) -> dict[str, Any] | None:
        manifests = rendered(**sets)
        mounts = {m["name"]: m["mountPath"] for m in container(manifests)["volumeMounts"]}
        volumes = {v["name"]: v for v in pod_spec(manifests)["volumes"]}
        assert ("models" in mounts) == ("models" in volumes)
        assert mounts.get("models", "/models") == env(manifests)["SPECSERVE_CACHE_DIR"]
        return volumes.get("models")

    pvc = models_volume()
    assert pvc is not None
    assert (
        pvc["persistentVolumeClaim"]["claimName"]
        == only(rendered(), "PersistentVolumeClaim")["metadata"]["name"]
    )
    existing = models_volume(**{"modelCache.existingClaim": "shared-models"})
    assert existing is not None
    assert existing["persistentVolumeClaim"]["claimName"] == "shared-models"
    empty = models_volume(**{"modelCache.type": "emptyDir"})
    assert empty is not None and empty["emptyDir"]["sizeLimit"] == "20Gi"
    assert models_volume(**{"modelCache.type": "image"}) is None


def test_pods_run_unprivileged(rendered: Render) -> None:
    spec = pod_spec(rendered())
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] != 0
    assert container(rendered())["securityContext"]["allowPrivilegeEscalation"] is False
    assert spec["automountServiceAccountToken"] is False


def test_every_env_var_is_a_server_setting(rendered: Render) -> None:
    fields = {f"SPECSERVE_{name.upper()}" for name in Settings.model_fields}
    for values in CI_VALUES:
        names = {name for name in env(rendered(values)) if name.startswith("SPECSERVE_")}
        assert names <= fields, f"{values.name}: not server settings: {names - fields}"


def test_prompt_cache_values_become_server_settings(rendered: Render) -> None:
    default = env(rendered())
    assert "SPECSERVE_BLOCK_SIZE" not in default
    assert "SPECSERVE_NO_PREFIX_CACHING" not in default
    assert "SPECSERVE_SHARED_PREFIX_CACHE" not in default
    given = env(
        rendered(
            **{
                "engine.blockSize": "32",
                "engine.prefixCaching": "false",
                "engine.sharedPrefixCache": "true",
            }
        )
    )
    assert given["SPECSERVE_BLOCK_SIZE"] == "32"
    assert given["SPECSERVE_NO_PREFIX_CACHING"] == "true"
    assert given["SPECSERVE_SHARED_PREFIX_CACHE"] == "true"


def test_prometheus_rule_is_deploy_prometheus_rules(rendered: Render, tmp_path: Path) -> None:
    rule = only(rendered(**{"metrics.prometheusRule.enabled": "true"}), "PrometheusRule")
    project = yaml.safe_load((ROOT / "deploy" / "prometheus" / "rules.yml").read_text())
    assert rule["spec"]["groups"] == project["groups"]
    rules_file = tmp_path / "rules.yml"
    rules_file.write_text(yaml.safe_dump(rule["spec"]))
    check = subprocess.run(
        [tool("promtool"), "check", "rules", str(rules_file)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_service_monitor_scrapes_the_metrics_service_as_job_specserve(rendered: Render) -> None:
    manifests = rendered(ci_values("monitoring"))
    monitor = only(manifests, "ServiceMonitor")
    metrics = service(manifests, f"{FULLNAME}-metrics")
    selector = monitor["spec"]["selector"]["matchLabels"].items()
    assert selector <= metrics["metadata"]["labels"].items()
    assert not selector <= service(manifests, FULLNAME)["metadata"]["labels"].items()
    # The SpecserveDown alert matches up{job="specserve"}.
    assert metrics["metadata"]["labels"][monitor["spec"]["jobLabel"]] == "specserve"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == metrics["spec"]["ports"][0]["name"]
    assert endpoint["path"] == "/metrics"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_dashboard_config_map_is_the_project_dashboard(rendered: Render) -> None:
    config_map = only(rendered(ci_values("monitoring")), "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = (ROOT / "deploy" / "grafana" / "dashboards" / "specserve.json").read_text()
    assert json.loads(config_map["data"]["specserve.json"]) == json.loads(dashboard)


MULTI_NODE = {"multiNode.enabled": "true", "gpu.enabled": "true", "gpu.count": "4"}
MULTI_NODE |= {"engine.tensorParallelSize": "8", "modelCache.type": "emptyDir"}


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        ({"autoscaling.enabled": "true", "keda.enabled": "true"}, "enable one"),
        ({"apiKeys.enabled": "true"}, "apiKeys.keys or apiKeys.existingSecret"),
        ({"engine.tensorParallelSize": "2"}, "must not exceed gpu.count"),
        ({"model.target": "org/model"}, "needs model.draft"),
        ({"speculation.numSpeculativeTokens": "0"}, "minimum"),
        ({"modelCache.type": "hostPath"}, "modelCache/type"),
        ({"unknownValue": "1"}, "additional properties"),
        ({**MULTI_NODE, "gpu.enabled": "false"}, "multiNode needs gpu.enabled"),
        ({**MULTI_NODE, "multiNode.size": "1"}, "don't meet the specifications of the schema"),
        ({**MULTI_NODE, "engine.tensorParallelSize": "4"}, "must equal multiNode.size x gpu"),
        ({**MULTI_NODE, "modelCache.type": "pvc"}, "modelCache.accessModes needs ReadWriteMany"),
        (
            {**MULTI_NODE, "engine.tensorParallelSize": "4", "engine.pipelineParallelSize": "2"},
            "cannot run a draft model",
        ),
        ({"router.enabled": "true", "router.metrics.port": "8000"}, "router.metrics.port must"),
        ({"router.enabled": "true", "router.policy": "kv_aware"}, "router/policy"),
    ],
)
def test_chart_refuses_settings_that_cannot_work(sets: dict[str, str], message: str) -> None:
    args = ["template", RELEASE, str(CHART)]
    for key, value in sets.items():
        args += ["--set", f"{key}={value}"]
    result = helm(*args)
    assert result.returncode != 0
    assert message in result.stderr


def test_notes_tell_how_to_reach_the_service() -> None:
    result = helm("install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE)
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("NOTES:", 1)[1]
    assert f"port-forward svc/{FULLNAME} 8000:8000" in notes
    assert "apiKeys.enabled is false" in notes


@pytest.mark.parametrize(("store", "warned"), [(None, True), ("redis.enabled=true", False)])
def test_notes_warn_when_replicas_keep_rate_limits_per_pod(store: str | None, warned: bool) -> None:
    sets = ["autoscaling.enabled=true", "apiKeys.enabled=true", "apiKeys.existingSecret=keys"]
    sets += [store] if store else []
    args = [arg for value in sets for arg in ("--set", value)]
    result = helm(
        "install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE, *args
    )
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("NOTES:", 1)[1]
    assert ("Rate limits are kept per pod" in notes) is warned


def _leaf_keys(values: dict[str, Any], prefix: str = "") -> set[str]:
    keys = set()
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and key not in FREE_FORM_VALUES:
            keys |= _leaf_keys(value, f"{path}.")
        else:
            keys.add(path)
    return keys


def test_readme_documents_every_value_and_schema_knows_it() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    readme = (CHART / "README.md").read_text()
    schema = json.loads((CHART / "values.schema.json").read_text())
    for key in sorted(_leaf_keys(values)):
        assert f"| `{key}` |" in readme, f"README.md does not document {key}"
        node = schema
        for part in key.split("."):
            assert part in node["properties"], f"values.schema.json does not know {key}"
            node = node["properties"][part]


def test_multi_node_is_a_leaderworkerset_whose_leader_serves_once_its_workers_join(
    rendered: Render,
) -> None:
    manifests = rendered(**MULTI_NODE)
    assert "Deployment" not in kinds(manifests)
    lws = only(manifests, "LeaderWorkerSet")
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader = container(manifests)
    (worker,) = group["workerTemplate"]["spec"]["containers"]
    # The leader: a Ray head, then specserve, which waits for both nodes before its engine
    # places 8 tensor-parallel ranks on the Ray cluster.
    assert leader["command"] == ["tini", "--", "sh", "-c"]
    assert leader["args"][0].startswith("ray start --head --port=6379 ")
    assert leader["args"][0].endswith("&& exec specserve serve")
    leader_env = env(manifests)
    assert leader_env["SPECSERVE_DISTRIBUTED_EXECUTOR_BACKEND"] == "ray"
    assert leader_env["SPECSERVE_RAY_NODES"] == "2"
    assert leader_env["RAY_ADDRESS"] == "127.0.0.1:6379"
    assert leader_env["SPECSERVE_TENSOR_PARALLEL_SIZE"] == "8"
    assert {"startupProbe", "readinessProbe", "livenessProbe", "lifecycle"} <= leader.keys()
    # A worker joins the leader's Ray head, on as many GPUs, reading the same models.
    assert '--address="$LWS_LEADER_ADDRESS:6379" --block' in worker["args"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert {m["mountPath"] for m in worker["volumeMounts"]} == {"/dev/shm", "/models"}
    # HTTP reaches leaders only.
    for name in (FULLNAME, f"{FULLNAME}-metrics"):
        assert service(manifests, name)["spec"]["selector"]["app.kubernetes.io/component"] == (
            "server"
        )
    assert group["leaderTemplate"]["metadata"]["labels"]["app.kubernetes.io/component"] == (
        "server"
    )
    assert group["workerTemplate"]["metadata"]["labels"]["app.kubernetes.io/component"] == (
        "ray-worker"
    )


def test_autoscalers_scale_whole_multi_node_replicas(rendered: Render) -> None:
    for setting, kind in [
        ("autoscaling.enabled", "HorizontalPodAutoscaler"),
        ("keda.enabled", "ScaledObject"),
    ]:
        manifests = rendered(**MULTI_NODE, **{setting: "true"})
        target = only(manifests, kind)["spec"]["scaleTargetRef"]
        assert (target["apiVersion"], target["kind"]) == (
            "leaderworkerset.x-k8s.io/v1",
            "LeaderWorkerSet",
        )
        assert "replicas" not in only(manifests, "LeaderWorkerSet")["spec"]


def test_pipeline_stages_with_ngram_speculation_render_on_several_nodes(rendered: Render) -> None:
    sets = {"engine.tensorParallelSize": "4", "engine.pipelineParallelSize": "2"}
    manifests = rendered(**{**MULTI_NODE, **sets, "speculation.method": "ngram"})
    leader_env = env(manifests)
    assert leader_env["SPECSERVE_PIPELINE_PARALLEL_SIZE"] == "2"
    assert leader_env["SPECSERVE_SPECULATIVE_METHOD"] == "ngram"


ROUTER = {"router.enabled": "true"}
ROUTER_NAME = f"{FULLNAME}-router"


def router_deployment(manifests: Manifests) -> dict[str, Any]:
    return deployment(manifests, ROUTER_NAME)


def router_container(manifests: Manifests) -> dict[str, Any]:
    (found,) = router_deployment(manifests)["spec"]["template"]["spec"]["containers"]
    result: dict[str, Any] = found
    return result


def flag(args: list[str], name: str) -> list[str]:
    """The values of a flag given once: the arguments after it, up to the next flag."""
    assert args.count(name) == 1, f"{name} given {args.count(name)} times: {args}"
    start = args.index(name) + 1
    end = next((i for i in range(start, len(args)) if args[i].startswith("--")), len(args))
    return args[start:end]


def labels_of(manifests: Manifests, kind: str, name: str) -> dict[str, str]:
    (found,) = [m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name]
    result: dict[str, str] = found["metadata"]["labels"]
    return result


def test_router_objects_appear_only_when_enabled(rendered: Render) -> None:
    default = rendered()
    assert not [m for m in default if m["metadata"]["name"].startswith(ROUTER_NAME)]
    monitored = rendered(ci_values("monitoring"))
    assert [m["metadata"]["name"] for m in monitored if m["kind"] == "ServiceMonitor"] == [FULLNAME]
    manifests = rendered(**ROUTER)
    assert kinds(manifests) == DEFAULT_KINDS | {"Role", "RoleBinding"}
    router_objects = {
        (m["kind"], m["metadata"]["name"])
        for m in manifests
        if m["metadata"]["name"].startswith(ROUTER_NAME)
    }
    assert router_objects == {
        ("Deployment", ROUTER_NAME),
        ("Service", ROUTER_NAME),
        ("Service", f"{ROUTER_NAME}-metrics"),
        ("ServiceAccount", ROUTER_NAME),
        ("Role", ROUTER_NAME),
        ("RoleBinding", ROUTER_NAME),
    }
    # The replicas' own objects are exactly what they are without the router.
    assert [m for m in manifests if not m["metadata"]["name"].startswith(ROUTER_NAME)] == default


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize(
    "sets", [ROUTER, {**MULTI_NODE, **ROUTER}], ids=["deployment", "multi-node"]
)
def test_router_manifests_validate_strictly(
    rendered: Render, sets: dict[str, str], version: str
) -> None:
    manifests = rendered(**sets)
    assert {"Role", "RoleBinding"} <= kinds(manifests)
    validate_strictly(manifests, version, "router.enabled")


@pytest.mark.parametrize(
    "sets",
    [ROUTER, {**ROUTER, "server.port": "8080"}, {**MULTI_NODE, **ROUTER}],
    ids=["default", "server-port", "multi-node"],
)
def test_router_discovers_the_pods_the_api_service_selects(
    rendered: Render, sets: dict[str, str]
) -> None:
    manifests = rendered(**sets)
    router = router_container(manifests)
    assert router["command"] == ["vllm-router"]
    args = router["args"]
    assert flag(args, "--service-discovery") == []
    selector = dict(item.split("=", 1) for item in flag(args, "--selector"))
    assert selector == service(manifests, FULLNAME)["spec"]["selector"]
    assert selector.items() <= server_pod_template(manifests)["metadata"]["labels"].items()
    # Its own namespace (a namespaced watch, which the Role allows), on the replicas' API port.
    assert flag(args, "--service-discovery-namespace") == [NAMESPACE]
    api_port = {p["name"]: p["containerPort"] for p in container(manifests)["ports"]}["http"]
    assert flag(args, "--service-discovery-port") == [str(api_port)]
    assert str(api_port) == sets.get("server.port", "8000")
    # Health checks on the replicas' readiness endpoint: 503 while draining, unlike /health.
    readiness = container(manifests)["readinessProbe"]["httpGet"]["path"]
    assert flag(args, "--health-check-endpoint") == [readiness] == ["/ready"]
    # Never the router's own pods, nor a multi-node replica's Ray workers.
    router_pods = router_deployment(manifests)["spec"]["template"]["metadata"]["labels"]
    assert not selector.items() <= router_pods.items()
    for lws in [m for m in manifests if m["kind"] == "LeaderWorkerSet"]:
        workers = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["metadata"]["labels"]
        assert not selector.items() <= workers.items()


def test_router_pods_and_replica_pods_never_select_each_other(rendered: Render) -> None:
    manifests = rendered(ci_values("router"))
    router_pods = router_deployment(manifests)["spec"]["template"]["metadata"]["labels"]
    replica_pods = server_pod_template(manifests)["metadata"]["labels"]
    assert router_pods["app.kubernetes.io/component"] == "router"
    replica_selectors = [
        deployment(manifests)["spec"]["selector"]["matchLabels"],
        service(manifests, FULLNAME)["spec"]["selector"],
        service(manifests, f"{FULLNAME}-metrics")["spec"]["selector"],
        only(manifests, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"],
    ]
    router_selectors = [
        router_deployment(manifests)["spec"]["selector"]["matchLabels"],
        service(manifests, ROUTER_NAME)["spec"]["selector"],
        service(manifests, f"{ROUTER_NAME}-metrics")["spec"]["selector"],
    ]
    for selector in replica_selectors:
        assert selector.items() <= replica_pods.items()
        assert not selector.items() <= router_pods.items(), selector
    for selector in router_selectors:
        assert selector.items() <= router_pods.items()
        assert not selector.items() <= replica_pods.items(), selector


def test_router_reads_pods_through_a_namespaced_role_of_its_own(rendered: Render) -> None:
    manifests = rendered(**ROUTER)
    pod = router_deployment(manifests)["spec"]["template"]["spec"]
    account = pod["serviceAccountName"]
    assert labels_of(manifests, "ServiceAccount", account)
    # The router's Kubernetes client needs the token; the replicas keep none and read no pods.
    assert pod["automountServiceAccountToken"] is True
    assert pod_spec(manifests)["serviceAccountName"] != account
    assert pod_spec(manifests)["automountServiceAccountToken"] is False
    role, binding = only(manifests, "Role"), only(manifests, "RoleBinding")
    (rule,) = role["rules"]
    assert rule["apiGroups"] == [""] and rule["resources"] == ["pods"]
    assert set(rule["verbs"]) == {"get", "list", "watch"}
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}
    ]
    assert not {"ClusterRole", "ClusterRoleBinding"} & kinds(manifests)


@pytest.mark.parametrize(
    "sets",
    [ROUTER, {**ROUTER, "router.port": "8100", "router.metrics.port": "29100"}],
    ids=["default", "ports"],
)
def test_router_listens_where_its_probes_and_services_look(
    rendered: Render, sets: dict[str, str]
) -> None:
    manifests = rendered(**sets)
    router = router_container(manifests)
    args = router["args"]
    ports = {port["name"]: port["containerPort"] for port in router["ports"]}
    assert ports == {
        "http": int(sets.get("router.port", "8000")),
        "metrics": int(sets.get("router.metrics.port", "29000")),
    }
    assert flag(args, "--host") == flag(args, "--prometheus-host") == ["0.0.0.0"]
    assert flag(args, "--port") == [str(ports["http"])]
    assert flag(args, "--prometheus-port") == [str(ports["metrics"])]
    # /readiness: ready with one healthy replica (/health would be 503 with any one down).
    assert router["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": "http"}
    assert router["livenessProbe"]["httpGet"] == {"path": "/liveness", "port": "http"}
    api, metrics = service(manifests, ROUTER_NAME), service(manifests, f"{ROUTER_NAME}-metrics")
    assert [p["targetPort"] for p in api["spec"]["ports"]] == ["http"]
    assert [p["targetPort"] for p in metrics["spec"]["ports"]] == ["metrics"]
    assert metrics["spec"]["type"] == "ClusterIP"
    assert router["image"] == "specserve:0.1.0-router"
    assert router["securityContext"]["readOnlyRootFilesystem"] is True
    pod = router_deployment(manifests)["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    # In-flight requests through the router get as long as the replicas' drain.
    pre_stop = router["lifecycle"]["preStop"]["exec"]["command"]
    assert (
        pod["terminationGracePeriodSeconds"] == pod_spec(manifests)["terminationGracePeriodSeconds"]
    )
    assert pre_stop == container(manifests)["lifecycle"]["preStop"]["exec"]["command"]


def test_service_monitors_scrape_the_router_apart_from_the_replicas(rendered: Render) -> None:
    manifests = rendered(ci_values("router"))
    monitors = {m["metadata"]["name"]: m for m in manifests if m["kind"] == "ServiceMonitor"}
    assert monitors.keys() == {FULLNAME, ROUTER_NAME}
    services = [m for m in manifests if m["kind"] == "Service"]

    def scraped(monitor: dict[str, Any]) -> list[str]:
        selector = monitor["spec"]["selector"]["matchLabels"].items()
        return [
            s["metadata"]["name"] for s in services if selector <= s["metadata"]["labels"].items()
        ]

    assert scraped(monitors[FULLNAME]) == [f"{FULLNAME}-metrics"]
    assert scraped(monitors[ROUTER_NAME]) == [f"{ROUTER_NAME}-metrics"]
    monitor, metrics = monitors[ROUTER_NAME], service(manifests, f"{ROUTER_NAME}-metrics")
    (endpoint,) = monitor["spec"]["endpoints"]
    (port,) = metrics["spec"]["ports"]
    assert endpoint["port"] == port["name"] and endpoint["path"] == "/metrics"
    router = router_container(manifests)
    (target,) = [p for p in router["ports"] if p["name"] == port["targetPort"]]
    assert flag(router["args"], "--prometheus-port") == [str(target["containerPort"])]
    # job="specserve-router": the replicas' SpecserveDown alert (job="specserve") never counts it.
    assert metrics["metadata"]["labels"][monitor["spec"]["jobLabel"]] == "specserve-router"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_router_policy_and_extra_args(rendered: Render) -> None:
    assert flag(router_container(rendered(**ROUTER))["args"], "--policy") == ["cache_aware"]
    sets = {"router.policy": "round_robin", "router.extraArgs": "{--retry-max-retries,3}"}
    args = router_container(rendered(**ROUTER, **sets))["args"]
    assert flag(args, "--policy") == ["round_robin"]
    assert args[-2:] == ["--retry-max-retries", "3"]


@pytest.mark.parametrize("keys", [False, True])
def test_notes_point_at_the_router(keys: bool) -> None:
    sets = ["router.enabled=true"]
    sets += ["apiKeys.enabled=true", "apiKeys.existingSecret=keys"] if keys else []
    args = [arg for value in sets for arg in ("--set", value)]
    result = helm(
        "install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE, *args
    )
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("NOTES:", 1)[1]
    assert f"port-forward svc/{ROUTER_NAME} 8000:8000" in notes
    assert f"port-forward svc/{FULLNAME} " not in notes
    assert ("/v1/responses reaches the replicas without the client's API key" in notes) is keys
