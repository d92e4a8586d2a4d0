"""The chart renders, lints, validates against Kubernetes schemas and wires itself up.

Every test that takes `values_files` runs with the default values and with each file in
helm/tiergate/ci/ (scale-out, existing Secret, CPU-only).
"""

from __future__ import annotations

import base64
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import SchemaNotFoundError, latest_version

from .conftest import CHART_DIR, CI_VALUES_DIR, NAMESPACE, Helm

# Kinds without a schema in kubernetes-validate (CRDs), checked by hand below instead.
CRD_KINDS = {"ServiceMonitor"}
# Template file prefix -> the kind it must hold (templates are named <kind>-<component>.yaml).
FILE_KINDS = {
    "configmap": "ConfigMap",
    "deployment": "Deployment",
    "hpa": "HorizontalPodAutoscaler",
    "job": "Job",
    "pdb": "PodDisruptionBudget",
    "secret": "Secret",
    "service": "Service",
    "servicemonitor": "ServiceMonitor",
}
STANDARD_LABELS = {
    "helm.sh/chart",
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/component",
    "app.kubernetes.io/version",
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/part-of",
}


def _min_kube_version() -> str:
    chart = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    match = re.search(r">=\s*(\d+\.\d+)", chart["kubeVersion"])
    assert match, chart["kubeVersion"]
    return f"{match.group(1)}.0"


def _by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [doc for doc in docs if doc["kind"] == kind]


def _one(docs: list[dict], kind: str, component: str) -> dict:
    found = [
        doc
        for doc in _by_kind(docs, kind)
        if doc["metadata"]["labels"]["app.kubernetes.io/component"] == component
    ]
    assert len(found) == 1, f"expected one {kind} for {component}, found {len(found)}"
    return found[0]


def _pod_specs(docs: list[dict]) -> list[tuple[str, dict]]:
    return [
        (doc["metadata"]["name"], doc["spec"]["template"]["spec"])
        for doc in docs
        if doc["kind"] in ("Deployment", "Job")
    ]


def _containers(docs: list[dict]) -> list[dict]:
    return [c for _, spec in _pod_specs(docs) for c in spec["containers"]]


def _hook_events(doc: dict) -> set[str]:
    hooks = doc["metadata"].get("annotations", {}).get("helm.sh/hook", "")
    return {h for h in hooks.split(",") if h}


def test_lint_passes(helm: Helm, values_files: tuple[Path, ...]) -> None:
    args = ["lint", str(CHART_DIR), "--strict"]
    for path in values_files:
        args += ["--values", str(path)]
    result = helm.run(*args)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("kube_version", [_min_kube_version(), str(latest_version())])
def test_manifests_match_kubernetes_schemas(
    helm: Helm, values_files: tuple[Path, ...], kube_version: str
) -> None:
    docs = helm.render(values_files)
    assert docs
    for doc in docs:
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        try:
            kubernetes_validate.validate(doc, kube_version, strict=True)
        except SchemaNotFoundError:
            assert doc["kind"] in CRD_KINDS, f"no Kubernetes schema for {name}"
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{name} is invalid for Kubernetes {kube_version}: {path}: {exc.message}")


def test_templates_are_named_for_their_kind(helm: Helm) -> None:
    docs = helm.render((CI_VALUES_DIR / "scale-out-values.yaml",))
    result = helm.template((CI_VALUES_DIR / "scale-out-values.yaml",))
    sources = re.findall(r"^# Source: tiergate/templates/(\S+)$", result.stdout, re.M)
    assert len(sources) == len(docs)
    for source, doc in zip(sources, docs, strict=True):
        prefix, _, component = source.removesuffix(".yaml").partition("-")
        assert component, f"{source} is not named <kind>-<component>.yaml"
        assert FILE_KINDS[prefix] == doc["kind"], f"{source} holds a {doc['kind']}"
    on_disk = {p.name for p in (CHART_DIR / "templates").glob("*.yaml")}
    assert on_disk == set(sources), "a template renders nothing under scale-out values"


def test_every_resource_has_the_standard_labels(helm: Helm, values_files) -> None:
    for doc in helm.render(values_files):
        missing = STANDARD_LABELS - set(doc["metadata"]["labels"])
        assert not missing, f"{doc['kind']}/{doc['metadata']['name']} lacks {missing}"
        assert doc["metadata"]["labels"]["app.kubernetes.io/instance"] == "tg"


def test_selectors_match_their_pods(helm: Helm, values_files) -> None:
    docs = helm.render(values_files)
    pods = {
        doc["metadata"]["labels"]["app.kubernetes.io/component"]: doc
        for doc in _by_kind(docs, "Deployment")
    }
    assert set(pods) == {"gateway", "worker"}
    for component, deployment in pods.items():
        selector = deployment["spec"]["selector"]["matchLabels"]
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= pod_labels.items()
        assert selector["app.kubernetes.io/component"] == component
    gateway_labels = pods["gateway"]["spec"]["template"]["metadata"]["labels"]
    service = _one(docs, "Service", "gateway")
    assert service["spec"]["selector"].items() <= gateway_labels.items()
    for pdb in _by_kind(docs, "PodDisruptionBudget"):
        component = pdb["metadata"]["labels"]["app.kubernetes.io/component"]
        labels = pods[component]["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for monitor in _by_kind(docs, "ServiceMonitor"):
        assert (
            monitor["spec"]["selector"]["matchLabels"].items()
            <= service["metadata"]["labels"].items()
        )
        assert monitor["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE]
        ports = {p["name"] for p in service["spec"]["ports"]}
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports
        assert all(e["path"] == "/metrics" for e in monitor["spec"]["endpoints"])


def test_gateway_probes_and_graceful_shutdown(helm: Helm, values_files) -> None:
    docs = helm.render(values_files)
    spec = _one(docs, "Deployment", "gateway")["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["command"] == ["tiergate"]
    assert container["args"] == ["gateway"]
    port_names = {p["name"] for p in container["ports"]}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert "http" in port_names
    pre_stop_s = 0
    if "lifecycle" in container:
        pre_stop_s = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    # The drain needs time after the preStop sleep, inside the grace period.
    assert spec["terminationGracePeriodSeconds"] >= pre_stop_s + 30


def test_service_targets_the_gateway_port(helm: Helm, values_files) -> None:
    docs = helm.render(values_files)
    service = _one(docs, "Service", "gateway")
    (container,) = _one(docs, "Deployment", "gateway")["spec"]["template"]["spec"]["containers"]
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "http"
    (http,) = [p for p in container["ports"] if p["name"] == "http"]
    env = _config_map(docs)["data"]
    assert env["TIERGATE_PORT"] == str(http["containerPort"])
    assert env["TIERGATE_HOST"] == "0.0.0.0"


def _config_map(docs: list[dict]) -> dict:
    (config_map,) = _by_kind(docs, "ConfigMap")
    return config_map


def test_gpu_worker_requests_a_gpu_on_gpu_nodes(helm: Helm) -> None:
    docs = helm.render()
    deployment = _one(docs, "Deployment", "worker")
    spec = deployment["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["args"] == ["worker"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["resources"]["limits"]["memory"] == "32Gi"
    assert container["image"].endswith("-cuda")
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
        "tolerations"
    ]
    # Never surge: the replacement would wait for a GPU the old pod still holds.
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0
    assert spec["terminationGracePeriodSeconds"] >= 60
    env = {e["name"]: e for e in container["env"]}
    assert env["TIERGATE_DEVICE"]["value"] == "cuda"


def test_cpu_worker_holds_no_gpu(helm: Helm) -> None:
    docs = helm.render((CI_VALUES_DIR / "cpu-values.yaml",))
    spec = _one(docs, "Deployment", "worker")["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert not any("gpu" in name for name in container["resources"]["limits"])
    assert container["image"].endswith("-cpu")
    assert "nodeSelector" not in spec
    assert "tolerations" not in spec


def test_scale_out_mounts_the_model_on_workers_and_gateways(helm: Helm) -> None:
    docs = helm.render((CI_VALUES_DIR / "scale-out-values.yaml",))
    assert _config_map(docs)["data"]["TIERGATE_MODEL"] == "/models/Qwen3-8B"
    for component in ("gateway", "worker"):
        spec = _one(docs, "Deployment", component)["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["model"]["persistentVolumeClaim"]["claimName"] == "tiergate-models"
        (container,) = spec["containers"]
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["model"] == {"name": "model", "mountPath": "/models", "readOnly": True}
    worker = _one(docs, "Deployment", "worker")
    assert worker["spec"]["replicas"] == 8
    assert worker["spec"]["template"]["spec"]["containers"][0]["image"] == (
        "registry.example.com/ml/tiergate:0.1.0-cuda"
    )


def test_hpa_owns_the_gateway_count_when_enabled(helm: Helm) -> None:
    docs = helm.render((CI_VALUES_DIR / "scale-out-values.yaml",))
    gateway = _one(docs, "Deployment", "gateway")
    hpa = _one(docs, "HorizontalPodAutoscaler", "gateway")
    assert "replicas" not in gateway["spec"]
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": gateway["metadata"]["name"],
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 24)
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300

    fixed = helm.render((CI_VALUES_DIR / "existing-secret-values.yaml",))
    assert not _by_kind(fixed, "HorizontalPodAutoscaler")
    assert _one(fixed, "Deployment", "gateway")["spec"]["replicas"] == 3


def test_migration_job_is_a_pre_install_and_pre_upgrade_hook(helm: Helm, values_files) -> None:
    docs = helm.render(values_files)
    (job,) = _by_kind(docs, "Job")
    assert _hook_events(job) == {"pre-install", "pre-upgrade"}
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert (container["command"], container["args"]) == (["tiergate"], ["migrate"])
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    assert {e["name"] for e in container["env"]} >= {"TIERGATE_DATABASE_URL"}
    assert "envFrom" not in container, "the ConfigMap does not exist yet at pre-install"


def test_migration_can_be_turned_off(helm: Helm) -> None:
    docs = helm.render(set_values=("migrations.enabled=false",))
    assert not _by_kind(docs, "Job")
    assert not any(_hook_events(doc) for doc in docs)


def test_every_reference_resolves_before_it_is_needed(helm: Helm, values_files) -> None:
    """Secrets and ConfigMaps a pod reads exist when it starts: a hook pod reads only hook
    resources of a lower weight, or the Secret the user made beforehand."""
    docs = helm.render(values_files)
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    for path in values_files:
        values = _merge(values, yaml.safe_load(path.read_text()))
    external = values["existingSecret"]["name"]
    rendered = {(doc["kind"], doc["metadata"]["name"]): doc for doc in docs}
    for doc in docs:
        if doc["kind"] not in ("Deployment", "Job"):
            continue
        weight = int(doc["metadata"].get("annotations", {}).get("helm.sh/hook-weight", 0))
        (container,) = doc["spec"]["template"]["spec"]["containers"]
        for source in container.get("envFrom", []):
            target = rendered[("ConfigMap", source["configMapRef"]["name"])]
            assert not _hook_events(doc) or _hook_events(target)
        for env in container.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref is None:
                continue
            if ref["name"] == external:
                assert ref["key"] in values["existingSecret"].values()
                continue
            secret = rendered[("Secret", ref["name"])]
            assert ref["key"] in secret["data"], f"{ref} not in {secret['metadata']['name']}"
            if _hook_events(doc):
                assert _hook_events(doc) <= _hook_events(secret)
                assert int(secret["metadata"]["annotations"]["helm.sh/hook-weight"]) < weight
            else:
                assert not _hook_events(secret), "a hook Secret is deleted after the hook"


def _merge(base: dict, override: dict) -> dict:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merged[key] = _merge(base[key], value)
        else:
            merged[key] = value
    return merged


def test_workers_see_only_what_they_need(helm: Helm) -> None:
    docs = helm.render()
    (worker,) = _one(docs, "Deployment", "worker")["spec"]["template"]["spec"]["containers"]
    (gateway,) = _one(docs, "Deployment", "gateway")["spec"]["template"]["spec"]["containers"]
    secret_vars = {"TIERGATE_DATABASE_URL", "TIERGATE_REDIS_URL", "TIERGATE_ADMIN_TOKEN"}
    assert {e["name"] for e in worker["env"]} & secret_vars == {"TIERGATE_REDIS_URL"}
    assert {e["name"] for e in gateway["env"]} >= secret_vars


def test_existing_secret_replaces_the_charts_own(helm: Helm) -> None:
    docs = helm.render((CI_VALUES_DIR / "existing-secret-values.yaml",))
    assert not _by_kind(docs, "Secret")
    refs = {
        env["name"]: env["valueFrom"]["secretKeyRef"]
        for container in _containers(docs)
        for env in container["env"]
        if "valueFrom" in env
    }
    assert refs["TIERGATE_DATABASE_URL"] == {"name": "tiergate-connections", "key": "DATABASE_URL"}
    assert refs["TIERGATE_REDIS_URL"] == {"name": "tiergate-connections", "key": "REDIS_URL"}
    assert refs["TIERGATE_ADMIN_TOKEN"] == {"name": "tiergate-connections", "key": "ADMIN_TOKEN"}
    for _, spec in _pod_specs(docs):
        assert spec["serviceAccountName"] == "tiergate"


def test_chart_secret_holds_the_configured_settings(helm: Helm) -> None:
    docs = helm.render((CI_VALUES_DIR / "scale-out-values.yaml",))
    secrets = {doc["metadata"]["name"]: doc for doc in _by_kind(docs, "Secret")}
    main = _decoded(secrets["tg-tiergate"])
    assert main == {
        "database-url": "postgresql+asyncpg://tiergate:change-me@pg.db.svc.cluster.local:5432/tiergate",
        "redis-url": "rediss://:change-me@redis.cache.svc.cluster.local:6380/0",
        "admin-token": "a-long-random-admin-token-from-your-vault",
    }
    assert _decoded(secrets["tg-tiergate-migrate"]) == {"database-url": main["database-url"]}


def test_admin_token_is_generated_when_unset(helm: Helm) -> None:
    tokens = {_decoded(_one(helm.render(), "Secret", "config"))["admin-token"] for _ in range(2)}
    assert len(tokens) == 2, "offline renders have no Secret to reuse, so each is fresh"
    assert all(re.fullmatch(r"[A-Za-z0-9]{48}", token) for token in tokens)


@pytest.mark.parametrize("token", ["short", "has a space in it and sixteen+"])
def test_an_admin_token_the_processes_refuse_is_refused_at_install(helm: Helm, token: str) -> None:
    result = helm.template(set_values=(f"adminToken={token}",))
    assert result.returncode != 0
    assert "adminToken must be at least 16 printable ASCII characters" in result.stderr
    chosen = "an-admin-token-of-32-characters"
    secret = _one(helm.render(set_values=(f"adminToken={chosen}",)), "Secret", "config")
    assert _decoded(secret)["admin-token"] == chosen


def _decoded(secret: dict) -> dict[str, str]:
    return {key: base64.b64decode(value).decode() for key, value in secret["data"].items()}


def test_config_changes_roll_the_pods(helm: Helm) -> None:
    def checksums(*set_values: str) -> dict:
        docs = helm.render(set_values=set_values)
        annotations = _one(docs, "Deployment", "gateway")["spec"]["template"]["metadata"][
            "annotations"
        ]
        return {k: v for k, v in annotations.items() if k.startswith("checksum/")}

    base = checksums()
    model = checksums("model.name=/models/other")
    redis = checksums("redis.url=redis://elsewhere:6379/0")
    assert base["checksum/config"] != model["checksum/config"]
    assert base["checksum/secret"] == model["checksum/secret"]
    assert base["checksum/secret"] != redis["checksum/secret"]


def test_opentelemetry_settings(helm: Helm) -> None:
    off = _config_map(helm.render())["data"]
    assert off["OTEL_SDK_DISABLED"] == "true"
    on_docs = helm.render((CI_VALUES_DIR / "scale-out-values.yaml",))
    on = _config_map(on_docs)["data"]
    assert on["OTEL_SDK_DISABLED"] == "false"
    assert on["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability:4317"
    assert on["OTEL_RESOURCE_ATTRIBUTES"] == "deployment.environment=prod"
    names = {
        env["value"]
        for container in _containers(on_docs)
        for env in container["env"]
        if env["name"] == "OTEL_SERVICE_NAME"
    }
    assert names == {"tiergate-gateway", "tiergate-worker"}


def test_extra_env_reaches_every_long_running_container(helm: Helm, tmp_path: Path) -> None:
    values = tmp_path / "extra-env.yaml"
    values.write_text('extraEnv:\n  - name: HF_HUB_OFFLINE\n    value: "1"\n')
    docs = helm.render((values,))
    for component in ("gateway", "worker"):
        (container,) = _one(docs, "Deployment", component)["spec"]["template"]["spec"]["containers"]
        assert {"name": "HF_HUB_OFFLINE", "value": "1"} in container["env"]


def test_pods_run_unprivileged_with_a_writable_tmp(helm: Helm, values_files) -> None:
    for name, spec in _pod_specs(helm.render(values_files)):
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["automountServiceAccountToken"] is False, name
        volumes = {v["name"]: v for v in spec["volumes"]}
        for container in spec["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            assert container["securityContext"]["readOnlyRootFilesystem"] is True
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            assert "emptyDir" in volumes[mounts["/tmp"]], name


def test_service_monitor_only_when_asked(helm: Helm) -> None:
    assert not _by_kind(helm.render(), "ServiceMonitor")
    docs = helm.render((CI_VALUES_DIR / "scale-out-values.yaml",))
    monitor = _one(docs, "ServiceMonitor", "gateway")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["endpoints"][0]["interval"] == "15s"


def test_every_tiergate_variable_the_chart_sets_is_one_tiergate_reads(
    helm: Helm, values_files
) -> None:
    """A misspelt or retired TIERGATE_* name in a values file would be silently ignored."""
    from gateway.settings import _ENV

    known = {*_ENV, "TIERGATE_METRICS_TOP_TENANTS"}
    for container in _containers(helm.render(values_files)):
        names = {e["name"] for e in container.get("env", [])}
        names |= {
            key
            for source in container.get("envFrom", [])
            for key in _env_from_keys(helm, values_files, source)
        }
        unknown = {n for n in names if n.startswith("TIERGATE_")} - known
        assert not unknown, f"{container['name']}: {sorted(unknown)}"


def _env_from_keys(helm: Helm, values_files, source: dict) -> set[str]:
    """The keys of a ConfigMap or Secret the chart renders itself, named in envFrom."""
    ref = source.get("configMapRef") or source.get("secretRef") or {}
    kind = "ConfigMap" if "configMapRef" in source else "Secret"
    for doc in _by_kind(helm.render(values_files), kind):
        if doc["metadata"]["name"] == ref.get("name"):
            return set(doc.get("data") or {}) | set(doc.get("stringData") or {})
    return set()  # an existing Secret of the operator's: not the chart's to check
