"""The Python API sits below the HTTP server: specter/api.py imports nothing from specter.serve, at top level
or inside a function (a lazy import runs whenever its function does), while specter.serve loads through it."""

from __future__ import annotations

import ast

from conftest import REPO

API = REPO / "specter" / "api.py"


def serve_imports(source: str) -> list[str]:
    """'line N: import X' for every import of specter.serve (or a module under it) in `source`."""
    def serve(name: str) -> bool:
        return name == "specter.serve" or name.startswith("specter.serve.")

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if serve(a.name)]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            module = node.module or ""
            names = [f"{module}.{a.name}" for a in node.names]
            if serve(module) or any(serve(n) for n in names):  # `from specter import serve` too
                found.append(f"line {node.lineno}: from {module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and serve(node.value):
            found.append(f"line {node.lineno}: names {node.value!r}")  # importlib.import_module("specter.serve…")
    return found


def test_the_python_api_imports_nothing_from_serve():
    assert serve_imports(API.read_text()) == []


def _imported_from(folder_or_file, module: str) -> set[str]:
    paths = [folder_or_file] if folder_or_file.is_file() else folder_or_file.rglob("*.py")
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == module:
                names |= {a.name for a in node.names}
    return names


def test_serve_loads_through_the_python_api():
    assert {"sampling_params", "TextStream"} <= _imported_from(REPO / "specter" / "serve", "specter.api")


def _calls(path, name: str) -> list[int]:
    return [n.lineno for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)
            and (getattr(n.func, "id", None) == name or getattr(n.func, "attr", None) == name)]


def test_one_scheduler_serves_the_api_and_the_server():
    """Both front doors step specter/scheduler.py's Scheduler; neither builds or steps a request loop itself
    (a second scheduler would keep its own admission, stop detection and cancellation)."""
    assert "Scheduler" in _imported_from(API, "specter.scheduler")
    assert "Scheduler" in _imported_from(REPO / "specter" / "serve" / "loop.py", "specter.scheduler")
    for path in [API, *(REPO / "specter" / "serve").rglob("*.py")]:
        assert _calls(path, "batch_loop") == [], f"{path.name} builds a request loop of its own"
        assert _calls(path, "make_generator") == [] or path == API, f"{path.name} seeds requests itself"


def test_an_import_of_serve_is_caught_at_top_level_and_inside_a_function():
    """The old api.py's shapes: a lazy `from specter.serve.build import load` in a function, a method's
    `from specter.serve.loop import batch_loop`; also `import specter.serve.x` and `from specter import serve`."""
    lazy = ("def load_overrides(overrides):\n    from specter.serve.build import MAX_BATCH\n"
            "    from specter.serve.build import load as build\n    return build(overrides, MAX_BATCH)\n")
    method = "class Engine:\n    def __init__(self):\n        from specter.serve.loop import batch_loop\n"
    assert serve_imports(lazy) == ["line 2: from specter.serve.build import MAX_BATCH",
                                   "line 3: from specter.serve.build import load"]
    assert serve_imports(method) == ["line 3: from specter.serve.loop import batch_loop"]
    assert serve_imports("import specter.serve.app\n") == ["line 1: import specter.serve.app"]
    assert serve_imports("from specter import serve\n") == ["line 1: from specter import serve"]
    assert serve_imports("from specter.assembly.config import ConfigError\nimport specter.api\n") == []
