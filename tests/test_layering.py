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


# ------------------------------------------------------------------------------------ public names only
SCANNED = ("baselines", "specter/harness")  # methods are assembled from the engine's public extension points
OTHER_LIBRARIES = ("torch", "sys", "os", "np", "F", "importlib", "tqdm", "plt", "pd")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _scanned_files() -> list[tuple[str, Path]]:
    out = []
    for folder in SCANNED:
        for path in sorted((REPO / folder).rglob("*.py")):
            mod = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
            out.append((mod, path))
    return out


def _private_uses(path: Path) -> list[str]:
    """Underscore names imported from specter, or read/written on anything but `self`/`cls` (an
    engine's or another object's private state)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("specter"):
            found += [f"line {node.lineno}: imports {node.module}.{a.name}" for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls", *OTHER_LIBRARIES):
                continue
            found.append(f"line {node.lineno}: uses .{node.attr} of {ast.unparse(owner)}")
    return found


def _overrides(mod: str, path: Path) -> list[str]:
    """Underscore methods or `self._x` state a class here shares with a specter base class it extends."""
    import importlib
    import inspect

    module = importlib.import_module(mod)
    tree = ast.parse(path.read_text())
    found = []
    for node in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        cls = getattr(module, node.name, None)
        if not inspect.isclass(cls):
            continue
        bases = [b for b in cls.__mro__[1:] if b.__module__.startswith("specter") and b.__module__ != mod]
        if not bases:
            continue
        sources = [inspect.getsource(b) for b in bases]
        names = {f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
        names |= {t.attr for t in ast.walk(node) if isinstance(t, ast.Attribute) and isinstance(t.ctx, ast.Store)
                  and isinstance(t.value, ast.Name) and t.value.id == "self"}
        for name in sorted(n for n in names if _private(n)):
            if any(f"def {name}(" in src or f"self.{name}" in src for src in sources):
                found.append(f"{node.name}.{name} overrides {bases[0].__module__}.{bases[0].__name__}'s private {name}")
    return found


def test_baselines_and_harness_use_only_public_engine_names():
    """No module under baselines/ or specter/harness/ imports, reads, writes or overrides an
    underscore name of another specter module: methods are a spec plus the public pieces they swap
    (drafter, planner, expert filter), never a subclass reaching into private hooks."""
    problems = {}
    for mod, path in _scanned_files():
        found = _private_uses(path) + _overrides(mod, path)
        if found:
            problems[mod] = found
    assert not problems, problems
