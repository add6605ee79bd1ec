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
    """Every engine module imports in a fresh interpreter where the app's rooms (`specter.assembly`,
    `specter.records`, `specter.experiments`), `hydra` and `omegaconf` cannot be imported."""
    code = f"""
import importlib, importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        for banned in ("specter.assembly", "specter.records", "specter.experiments", "hydra", "omegaconf"):
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


# ------------------------------------------------------------------------------------ the import graph
# The app: what assembles, runs, serves and reports; the engine reaches none of it, however indirectly.
ROOMS = ("specter.assembly", "specter.records", "specter.experiments")
APP = ROOMS + ("specter.serve", "specter.cli", "specter.api", "specter.scheduler", "specter.reproduce",
       "specter.figures", "baselines")
ENGINE = tuple(f"specter.{m}" for m in ENGINE_PACKAGES + ENGINE_MODULES) + (
    "specter.projection.clock", "specter.projection.cost_model")  # the projection's torch-free clock and costs


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def module_files(root: Path, tops: tuple[str, ...] = ("specter", "baselines")) -> dict[str, Path]:
    """Dotted module name -> file, for the packages under `root`."""
    return {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
            for top in tops if (root / top).is_dir() for p in (root / top).rglob("*.py")}


def _imports(path: Path, module: str, modules: dict[str, Path]) -> set[str]:
    """The modules of `modules` that `path` imports, at top level or inside functions (lazy imports
    count: they run whenever the function does). `from pkg import name` is pkg.name when that is a
    module, else pkg; a dotted name that is not a module resolves to its nearest module."""
    def nearest(name: str) -> str | None:
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        return name if name in modules else None

    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {nearest(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                name = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out |= {f"{name}.{a.name}" if f"{name}.{a.name}" in modules else nearest(name) for a in node.names}
    return {m for m in out if m is not None and m != module}


def import_graph(root: Path = REPO, tops: tuple[str, ...] = ("specter", "baselines")) -> dict[str, set[str]]:
    """module -> the modules it imports (lazy, function-level imports included)."""
    modules = module_files(root, tops)
    return {mod: _imports(path, mod, modules) for mod, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return trail + [node, nxt]
            if nxt not in state and (found := visit(nxt, trail + [node])):
                return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node, [])):
            return found
    return None


def paths_to(graph: dict[str, set[str]], sources: tuple[str, ...], targets: tuple[str, ...]) -> dict[str, list[str]]:
    """For each module within `sources` that reaches a module within `targets` (through any number of
    other modules), its shortest such import path."""
    found = {}
    for start in sorted(m for m in graph if _within(m, sources)):
        before: dict[str, str | None] = {start: None}
        queue = [start]
        while queue:
            node = queue.pop(0)
            if _within(node, targets):
                path = [node]
                while before[path[-1]] is not None:
                    path.append(before[path[-1]])
                found[start] = path[::-1]
                break
            for nxt in sorted(graph.get(node, ())):
                if nxt not in before:
                    before[nxt] = node
                    queue.append(nxt)
    return found


def test_no_import_cycle():
    """The module import graph of specter (lazy, function-level imports included) is acyclic."""
    cycle = find_cycle(import_graph(REPO, ("specter",)))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_engine_never_reaches_the_app():
    """No engine module reaches the app (harness, serve, cli, the Python API, reproduce, figures,
    baselines) through any chain of imports, lazy ones included."""
    leaks = paths_to(import_graph(), ENGINE, APP)
    assert not leaks, "\n".join(" -> ".join(path) for path in leaks.values())


def test_an_indirect_path_to_the_app_is_caught(tmp_path):
    """An engine module that reaches the harness only through a tool module, by a lazy import inside
    a function, is caught; a clean engine module is not (a synthetic tree on disk and a bare graph)."""
    files = {
        "specter/__init__.py": "",
        "specter/models/__init__.py": "",
        "specter/models/trainer.py": "def check():\n    from specter.tool import report\n    return report()\n",
        "specter/models/clean.py": "from specter.paths import x\n",
        "specter/paths.py": "x = 1\n",
        "specter/tool.py": "from specter import paths\n\ndef report():\n    from specter.assembly.compose import CONF\n",
        "specter/assembly/__init__.py": "",
        "specter/assembly/compose.py": "CONF = 1\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    leaks = paths_to(import_graph(tmp_path, ("specter",)), ENGINE, APP)
    assert leaks == {"specter.models.trainer": ["specter.models.trainer", "specter.tool", "specter.assembly.compose"]}
    graph = {"specter.offload.cache": {"specter.metrics"}, "specter.metrics": {"specter.util"},
             "specter.util": {"specter.util2"}, "specter.util2": {"baselines.common"}}
    assert paths_to(graph, ENGINE, APP)["specter.offload.cache"][-1] == "baselines.common"
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


# ------------------------------------------------------------------------------------ the app's rooms
# Three rooms, imports one way: experiments -> records -> assembly (and experiments -> assembly). The
# projection's drivers sit beside records: they build methods (assembly) and never run an experiment.
# The front doors (serve, the command line, the Python API) and the baselines enter through assembly only.
BELOW = {
    "specter.assembly": ("baselines", "specter.records", "specter.experiments", "specter.projection.engine_run",
                         "specter.projection.steps", "specter.reproduce", "specter.figures", "specter.serve",
                         "specter.api", "specter.scheduler", "specter.cli"),
    "specter.records": ("specter.experiments", "specter.reproduce", "specter.figures", "specter.serve"),
    "specter.projection": ("specter.experiments", "specter.reproduce", "specter.figures", "specter.serve"),
    "specter.serve": ("specter.records", "specter.experiments"),
    "specter.cli": ("specter.records", "specter.experiments"),
    "specter.api": ("specter.records", "specter.experiments"),
    "specter.scheduler": ("specter.records", "specter.experiments", "specter.serve", "specter.api"),
    "baselines": ("specter.records", "specter.experiments", "specter.serve", "specter.cli", "specter.api",
                  "specter.scheduler"),
}


def direct_violations(graph: dict[str, set[str]], rules: dict[str, tuple[str, ...]]) -> list[str]:
    return sorted(f"{mod} -> {dep}" for mod, deps in graph.items() for room, banned in rules.items()
                  if _within(mod, (room,)) for dep in deps if _within(dep, banned))


def test_rooms_import_one_way():
    """assembly imports neither records nor experiments nor baselines (a baseline's sizing is a classmethod on
    its class, which the registry imports by name); records never imports experiments; serve, the
    command line, the Python API and the baselines import only assembly among the rooms. Transitively:
    a room that reaches a higher one through any other module fails too."""
    graph = import_graph()
    assert not direct_violations(graph, BELOW), direct_violations(graph, BELOW)
    for room, banned in BELOW.items():
        leaks = paths_to(graph, (room,), banned)
        assert not leaks, "\n".join(" -> ".join(path) for path in leaks.values())


def test_each_room_is_under_2500_lines():
    for room in ROOMS:
        folder = REPO / room.replace(".", "/")
        lines = sum(len(p.read_text().splitlines()) for p in folder.rglob("*.py"))
        assert 0 < lines < 2500, f"{room}: {lines} lines"
    assert not (REPO / "specter" / "harness").exists()


def test_a_room_reaching_up_is_caught():
    graph = {"specter.assembly.methods": {"specter.util"}, "specter.util": {"specter.records.output"},
             "specter.records.output": set(), "specter.serve.app": {"specter.assembly.config"}}
    assert paths_to(graph, ("specter.assembly",), BELOW["specter.assembly"]) == {
        "specter.assembly.methods": ["specter.assembly.methods", "specter.util", "specter.records.output"]}
    assert direct_violations({"specter.serve.app": {"specter.experiments.batch"}}, BELOW) == [
        "specter.serve.app -> specter.experiments.batch"]


# ------------------------------------------------------------------------------------ public names only
SCANNED = ("baselines", "specter/assembly", "specter/records", "specter/experiments")  # methods are assembled from the engine's public extension points
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
    """No module under baselines/ or the app's rooms imports, reads, writes or overrides an
    underscore name of another specter module: methods are a spec plus the public pieces they swap
    (drafter, planner, expert filter), never a subclass reaching into private hooks."""
    problems = {}
    for mod, path in _scanned_files():
        found = _private_uses(path) + _overrides(mod, path)
        if found:
            problems[mod] = found
    assert not problems, problems
