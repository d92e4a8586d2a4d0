"""The chart relies only on what the Dockerfile provides.

No container engine runs in CI, so the image is checked where it meets the chart and the
package: the variants and tags, the entrypoint and its subcommands, the user, the port, and
a build context that holds every package `pip install .` needs.
"""

from __future__ import annotations

import fnmatch
import json
import re
import subprocess
import sys
import tomllib

import pytest
import yaml

from .conftest import CHART_DIR, ROOT, Helm, ci_values_files

DOCKERFILE = ROOT / "Dockerfile"
# The processes the chart runs, by subcommand of the `tiergate` console script.
CHART_SUBCOMMANDS = {"gateway", "worker", "migrate"}
CLI_TIMEOUT_S = 60


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    found = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            found.append((keyword.upper(), rest.strip()))
    return found


def _last(keyword: str) -> str:
    values = [rest for kw, rest in _instructions() if kw == keyword]
    assert values, f"Dockerfile has no {keyword}"
    return values[-1]


def _variants() -> set[str]:
    stages = re.findall(r"\bAS\s+base-(\S+)", DOCKERFILE.read_text(), re.I)
    return set(stages)


def _rendered_containers(helm: Helm) -> list[dict]:
    containers = []
    for values in [(), *((path,) for path in ci_values_files())]:
        for doc in helm.render(values):
            if doc["kind"] in ("Deployment", "Job"):
                containers += doc["spec"]["template"]["spec"]["containers"]
    return containers


def test_variants_match_the_image_tags_the_chart_uses(helm: Helm) -> None:
    default_variant = re.search(r"^ARG VARIANT=(\S+)$", DOCKERFILE.read_text(), re.M)
    assert default_variant
    assert default_variant.group(1) in _variants() == {"cpu", "cuda"}
    assert ("FROM", "base-${VARIANT} AS base") in _instructions()
    suffixes = {c["image"].rsplit("-", 1)[-1] for c in _rendered_containers(helm)}
    assert suffixes <= _variants()


def test_the_chart_runs_the_images_entrypoint(helm: Helm) -> None:
    entrypoint = json.loads(_last("ENTRYPOINT"))
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert entrypoint == ["tiergate"]
    assert "tiergate" in scripts
    for container in _rendered_containers(helm):
        assert container["command"] == entrypoint
        assert container["args"][0] in CHART_SUBCOMMANDS
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec")
        if pre_stop:
            # Present in both base images (coreutils), so the image need not add it.
            assert pre_stop["command"][0] == "sleep"


@pytest.mark.parametrize("subcommand", sorted(CHART_SUBCOMMANDS))
def test_the_cli_has_every_subcommand_the_chart_runs(subcommand: str) -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = scripts["tiergate"].partition(":")
    code = f"import sys; from {module} import {function}; sys.exit({function}())"
    result = subprocess.run(
        [sys.executable, "-c", code, subcommand, "--help"],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, f"tiergate {subcommand} --help:\n{result.stderr}"


def test_user_and_port_match_the_chart() -> None:
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    user, _, group = _last("USER").partition(":")
    assert int(user) == values["podSecurityContext"]["runAsUser"]
    assert int(group) == values["podSecurityContext"]["runAsGroup"]
    assert int(_last("EXPOSE")) == values["gateway"]["port"]
    env = " ".join(rest for kw, rest in _instructions() if kw == "ENV")
    assert f"TIERGATE_PORT={values['gateway']['port']}" in env
    assert "TIERGATE_HOST=0.0.0.0" in env


def test_build_context_holds_every_package() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    ignored = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    copied = set()
    for keyword, rest in _instructions():
        if keyword == "COPY" and not rest.startswith("--from"):
            *sources, _ = rest.split()
            copied |= {source.rstrip("/") for source in sources}
    for source in copied:
        assert (ROOT / source).exists(), f"COPY {source}: no such path"
        assert not any(fnmatch.fnmatch(source, pattern) for pattern in ignored), source
    assert {"pyproject.toml", pyproject["project"]["readme"]} <= copied
    for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]:
        package = pattern.rstrip("*")
        assert (ROOT / package / "__init__.py").exists(), package
        assert package in copied, f"the image would be built without {package}/"
