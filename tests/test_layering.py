"""The engine is usable without the harness or Hydra, and no module imports form a cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENGINE_PACKAGES = ("models", "quant", "kernels", "offload", "predict", "speculative")
ENGINE_MODULES = ("moe", "metrics", "paths")


def _modules(package: Path, prefix: str) -> list[str]:
    return sorted(
        prefix + "." + ".".join(p.relative_to(package).with_suffix("").parts).removesuffix(".__init__")
        for p in package.rglob("*.py")
    )


def engine_modules() -> list[str]:
    mods = [f"specter.{m}" for m in ENGINE_MODULES]
    for pkg in ENGINE_PACKAGES:
        mods += _modules(REPO / "specter" / pkg, f"specter.{pkg}")
    return [m.removesuffix(".") for m in mods]


def test_engine_imports_with_harness_and_hydra_blocked():
    """Every engine module imports in a fresh interpreter where `specter.harness`, `hydra` and
    `omegaconf` cannot be imported."""
    code = f"""
import importlib, importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        for banned in ("specter.harness", "hydra", "omegaconf"):
            if name == banned or name.startswith(banned + "."):
                raise ImportError(f"engine module imported {{name}}")
        return None
sys.meta_path.insert(0, Block())
for mod in {engine_modules()!r}:
    importlib.import_module(mod)
print("ok")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]


def _imports(path: Path, module: str) -> set[str]:
    """specter.* modules a file imports (top-level or inside functions), resolved to module names."""
    tree = ast.parse(path.read_text())
    out = set()
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("specter")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name.startswith("specter"):
                out.add(name)
                out |= {f"{name}.{a.name}" for a in node.names}
    return out


def test_no_import_cycle():
    """The module import graph of specter (lazy, function-level imports included) is acyclic."""
    modules = {m: p for p in (REPO / "specter").rglob("*.py")
               for m in [".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")]}
    graph: dict[str, set[str]] = {}
    for mod, path in modules.items():
        for dep in _imports(path, mod):
            while dep not in modules and "." in dep:  # `from pkg.mod import name` -> pkg.mod
                dep = dep.rsplit(".", 1)[0]
            if dep in modules and dep != mod and not modules[dep].name == "__init__.py":
                graph.setdefault(mod, set()).add(dep)
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(trail + [node, nxt]))
            if nxt not in state:
                visit(nxt, trail + [node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    engine = [m for m in graph if m.split(".")[1] in ENGINE_PACKAGES + ENGINE_MODULES]
    leaks = {m: sorted(d for d in graph[m] if d.startswith("specter.harness")) for m in engine}
    assert not any(leaks.values()), leaks
