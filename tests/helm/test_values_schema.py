"""values.schema.json refuses bad values before anything reaches the cluster, and
values.yaml documents every value the schema knows (and nothing it does not)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from .conftest import CHART_DIR, Helm

SCHEMA = json.loads((CHART_DIR / "values.schema.json").read_text())


@pytest.mark.parametrize(
    ("values", "error"),
    [
        pytest.param("gateway:\n  replicaCount: -1\n", "/gateway/replicaCount", id="gateway-neg"),
        pytest.param("worker:\n  replicaCount: -2\n", "/worker/replicaCount", id="worker-neg"),
        pytest.param('database:\n  url: ""\n', "/database/url", id="empty-database-url"),
        pytest.param("database:\n  url: null\n", "missing property 'url'", id="no-database-url"),
        pytest.param('redis:\n  url: ""\n', "/redis/url", id="empty-redis-url"),
        pytest.param(
            "database:\n  url: postgresql://u@db/tiergate\n", "/database/url", id="sync-driver"
        ),
        pytest.param("redis:\n  url: http://redis:6379\n", "/redis/url", id="redis-scheme"),
        pytest.param("worker:\n  device: tpu\n", "/worker/device", id="unknown-device"),
        pytest.param("worker:\n  gpu:\n    count: 0\n", "/worker/gpu/count", id="cuda-no-gpu"),
        pytest.param(
            "worker:\n  device: cpu\n", "/worker/gpu/count", id="cpu-worker-holding-a-gpu"
        ),
        pytest.param(
            "gateway:\n  autoscaling:\n    minReplicas: 0\n",
            "/gateway/autoscaling/minReplicas",
            id="hpa-min-zero",
        ),
        pytest.param(
            "gateway:\n  podDisruptionBudget:\n    maxUnavailable: 0\n",
            "/gateway/podDisruptionBudget/maxUnavailable",
            id="pdb-blocks-drains",
        ),
        pytest.param("gateway:\n  replicas: 3\n", "replicas", id="typo-key"),
        pytest.param("image:\n  pullPolicy: Sometimes\n", "/image/pullPolicy", id="pull-policy"),
        pytest.param("otel:\n  enabled: true\n", "/otel", id="otel-without-endpoint"),
        pytest.param(
            "extraEnv:\n  - name: HF_HUB_OFFLINE\n    value: 1\n",
            "/extraEnv/0/value",
            id="unquoted-env-number",
        ),
        pytest.param("scratchSizeLimit: lots\n", "/scratchSizeLimit", id="bad-quantity"),
        pytest.param(
            "serviceMonitor:\n  enabled: true\n  interval: often\n",
            "/serviceMonitor/interval",
            id="bad-duration",
        ),
        pytest.param(
            "existingSecret:\n  name: tg\n  databaseUrlKey: ''\n",
            "/existingSecret/databaseUrlKey",
            id="empty-secret-key",
        ),
    ],
)
def test_schema_rejects(helm: Helm, tmp_path: Path, values: str, error: str) -> None:
    path = tmp_path / "values.yaml"
    path.write_text(values)
    result = helm.template((path,))
    assert result.returncode != 0, f"accepted:\n{values}"
    assert "don't meet the specifications of the schema" in result.stderr
    assert error in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("set_values", "error"),
    [
        pytest.param(
            ("gateway.autoscaling.minReplicas=5", "gateway.autoscaling.maxReplicas=2"),
            "maxReplicas (2) must be at least minReplicas (5)",
            id="hpa-max-below-min",
        ),
        pytest.param(
            ("gateway.preStopSleepSeconds=30", "gateway.terminationGracePeriodSeconds=30"),
            "no time is left to drain",
            id="no-drain-time",
        ),
    ],
)
def test_templates_reject_inconsistent_values(
    helm: Helm, set_values: tuple[str, ...], error: str
) -> None:
    result = helm.template(set_values=set_values)
    assert result.returncode != 0
    assert error in result.stderr, result.stderr


def test_missing_urls_are_fine_with_an_existing_secret(helm: Helm, tmp_path: Path) -> None:
    path = tmp_path / "values.yaml"
    path.write_text("existingSecret:\n  name: mine\ndatabase:\n  url: null\nredis:\n  url: ''\n")
    docs = helm.render((path,))
    assert not [doc for doc in docs if doc["kind"] == "Secret"]


def test_zero_replicas_are_allowed(helm: Helm) -> None:
    """Scaling a component to zero is a legitimate way to pause it; only negatives fail."""
    docs = helm.render(
        set_values=(
            "gateway.autoscaling.enabled=false",
            "gateway.replicaCount=0",
            "worker.replicaCount=0",
        )
    )
    assert {doc["spec"]["replicas"] for doc in docs if doc["kind"] == "Deployment"} == {0}


# Typed values that are documented as one value (their children are Kubernetes fields).
_LEAF_DEFINITIONS = {"resources", "probeTiming", "quantity", "envList", "duration"}


def _values_paths() -> dict[str, int]:
    """Dotted path -> line number of every key in values.yaml, down to schema leaves."""
    paths: dict[str, int] = {}
    stack: list[tuple[int, str]] = []
    for number, line in enumerate((CHART_DIR / "values.yaml").read_text().splitlines(), 1):
        match = re.match(r"^( *)([A-Za-z][\w.-]*):", line)
        if not match:
            continue
        indent = len(match.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([*(key for _, key in stack), match.group(2)])
        stack.append((indent, match.group(2)))
        paths[path] = number
    return paths


def _documented_leaves() -> set[str]:
    """Dotted paths of the values the schema types: sections recurse, the rest are leaves."""
    leaves: set[str] = set()

    def walk(schema: dict, path: str) -> None:
        ref = schema.get("$ref", "").removeprefix("#/definitions/")
        if ref in _LEAF_DEFINITIONS or ("properties" not in schema and not ref):
            leaves.add(path)
            return
        if ref:
            walk(SCHEMA["definitions"][ref], path)
            return
        for key, child in schema["properties"].items():
            if key != "global":
                walk(child, f"{path}.{key}" if path else key)

    walk(SCHEMA, "")
    return leaves


def test_values_yaml_and_schema_cover_the_same_values() -> None:
    in_values = _values_paths()
    leaves = _documented_leaves()
    missing = {leaf for leaf in leaves if leaf not in in_values}
    assert not missing, f"schema values absent from values.yaml: {sorted(missing)}"
    sections = {path for path in in_values if any(leaf.startswith(f"{path}.") for leaf in leaves)}
    unknown = {
        path
        for path in in_values
        if path not in leaves
        and path not in sections
        and not any(path.startswith(f"{leaf}.") for leaf in leaves)
    }
    assert not unknown, f"values.yaml keys the schema does not know: {sorted(unknown)}"


def test_every_value_is_documented() -> None:
    lines = (CHART_DIR / "values.yaml").read_text().splitlines()
    in_values = _values_paths()
    undocumented = []
    for leaf in _documented_leaves():
        above = lines[in_values[leaf] - 2].strip()
        if not above.startswith("#"):
            undocumented.append(leaf)
    assert not undocumented, f"values without a comment right above: {sorted(undocumented)}"


def test_default_values_pass_the_schema_as_written() -> None:
    """The defaults must satisfy the schema on their own (helm also checks them merged)."""
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    errors = [e.message for e in jsonschema.Draft7Validator(SCHEMA).iter_errors(values)]
    assert not errors
