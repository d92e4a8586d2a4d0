"""The layer rule: gateway -> scheduler -> engine -> kernels, imports point down only.

Also: kernels imports only torch and triton (and the standard library); only gateway/
touches starlette, SQL or alembic; scheduler/ and the pure parts of engine/ import with
torch unavailable, so policy runs in the simulator and on any CPU.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["kernels", "engine", "scheduler", "gateway"]
RANK = {name: i for i, name in enumerate(LAYERS)}
GATEWAY_ONLY = {"starlette", "sqlalchemy", "alembic", "uvicorn"}
# engine modules that must import without torch (the policy half of the engine).
PURE_ENGINE = {
    "engine",
    "engine.request",
    "engine.errors",
    "engine.block_manager",
    "engine.step_scheduler",
    "engine.cost_model",
}


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_imports_point_down_only() -> None:
    bad = []
    for package in LAYERS:
        for path in _modules(package):
            for lineno, name in _imports(path):
                top = name.split(".")[0]
                where = f"{path.relative_to(ROOT)}:{lineno} imports {name}"
                if top in RANK and RANK[top] > RANK[package]:
                    bad.append(f"{where} (a layer above {package})")
                if package != "gateway" and top in GATEWAY_ONLY:
                    bad.append(f"{where} (only gateway/ may)")
    assert bad == []


def test_kernels_import_only_torch_and_triton() -> None:
    allowed = {"torch", "triton", "kernels", "__future__"} | set(sys.stdlib_module_names)
    bad = [
        f"{path.relative_to(ROOT)}:{lineno} imports {name}"
        for path in _modules("kernels")
        for lineno, name in _imports(path)
        if name.split(".")[0] not in allowed
    ]
    assert bad == []


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _pure_modules() -> list[str]:
    names = [_module_name(p) for p in _modules("scheduler")]
    names += [n for n in map(_module_name, _modules("engine")) if n in PURE_ENGINE]
    return sorted(names)


@pytest.mark.parametrize("module", _pure_modules())
def test_policy_imports_without_torch(module: str) -> None:
    # A None entry in sys.modules makes `import torch` raise ImportError.
    code = (
        "import sys\n"
        "for blocked in ('torch', 'triton', 'transformers'):\n"
        "    sys.modules[blocked] = None\n"
        f"import {module}\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
