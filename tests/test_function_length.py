"""No function or method outside specter/kernels/ is longer than MAX_LINES: a long one is split into
helpers whose names say what each part does. Kernels are exempt (a fused kernel is one unit)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_LINES = 80
ROOTS = ("specter", "scripts", "baselines", "run.py", "make_figures.py")
EXEMPT = ("specter/kernels",)


def python_files(root: Path = REPO) -> list[Path]:
    files: list[Path] = []
    for name in ROOTS:
        path = root / name
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files += sorted(path.rglob("*.py"))
    return [f for f in files if not any(f.relative_to(root).as_posix().startswith(e + "/") for e in EXEMPT)
            and "tests" not in f.relative_to(root).parts]


def long_functions(path: Path, limit: int = MAX_LINES) -> list[tuple[str, int, int]]:
    """(qualified name, first line, length) of every function in `path` (nested ones and methods included)
    longer than `limit` lines, counted from `def` to its last line, decorators not included."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                length = child.end_lineno - child.lineno + 1
                if length > limit:
                    found.append((name, child.lineno, length))
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(), filename=str(path)), "")
    return found


def test_no_function_is_longer_than_the_limit():
    too_long = [f"{path.relative_to(REPO)}:{line} {name} ({length} lines)"
                for path in python_files() for name, line, length in long_functions(path)]
    assert not too_long, f"functions longer than {MAX_LINES} lines:\n" + "\n".join(too_long)


def test_the_check_sees_nested_functions_and_methods(tmp_path):
    body = "\n".join(["    x = 1"] * 81)
    (tmp_path / "m.py").write_text(f"def outer():\n    def inner():\n{body.replace('    ', '        ')}\n"
                                   f"class C:\n    async def method(self):\n{body.replace('    ', '        ')}\n")
    assert long_functions(tmp_path / "m.py") == [("outer", 1, 83), ("outer.inner", 2, 82), ("C.method", 85, 82)]
