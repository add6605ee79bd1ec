"""docs/architecture.md is kept true by the code: its layer table against the import graph, and the files,
classes, functions and methods its call trees name against their definitions.

tests/test_layering.py checks the code against fixed rules (the engine never reaches the app, the rooms import
one way); this test checks the DOC: every module of specter/ and baselines/ sits in exactly one row of the
table, no module imports a module of a later (higher) row, and every `path.py Name`, `path.py Class.method`,
`Class.method` and `specter.module.name` the doc names exists.
"""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
TOPS = ("specter", "baselines")  # the module files every row of the table must cover between them
TABLE_HEADING = "## The packages and the one rule"

# Imports the table's order does not explain, each with its reason. Keep it empty: move the module in the doc.
ALLOWED: dict[tuple[str, str], str] = {}


# ------------------------------------------------------------------------------------ the import graph
def module_files(root: Path = REPO) -> dict[str, Path]:
    """Dotted module name -> file, for specter/, baselines/ and the top-level scripts."""
    files = [p for top in TOPS if (root / top).is_dir() for p in (root / top).rglob("*.py")]
    files += [p for p in root.glob("*.py")]
    return {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p for p in files}


def _dynamic_imports(tree: ast.AST) -> list[str]:
    """The string constants handed to `importlib.import_module(...)`, `import_module(...)` or `__import__(...)`."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                out.append(node.args[0].value)
    return out


def imports_of(path: Path, module: str, modules: dict[str, Path]) -> set[str]:
    """The modules of `modules` that `path` imports: at top level, inside functions or under TYPE_CHECKING,
    and by `importlib.import_module("...")` constants. `from pkg import name` is pkg.name when that is a
    module, else pkg; a dotted name that is not a module resolves to its nearest enclosing module. (A parent
    package's __init__, which Python runs first, is not counted: it is an edge of no import statement.)"""
    def nearest(name: str) -> str | None:
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        return name if name in modules else None

    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str | None] = {nearest(name) for name in _dynamic_imports(tree) if not name.startswith(".")}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {nearest(alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found |= {f"{name}.{a.name}" if f"{name}.{a.name}" in modules else nearest(name) for a in node.names}
    return {m for m in found if m is not None and m != module}


def import_graph(root: Path = REPO) -> dict[str, set[str]]:
    modules = module_files(root)
    return {mod: imports_of(path, mod, modules) for mod, path in modules.items()}


# ------------------------------------------------------------------------------------ the layer table
def layer_table(text: str) -> list[tuple[str, list[str]]]:
    """(layer, backticked paths of its packages column), in the table's order (the bottom layer first)."""
    section = text.split(TABLE_HEADING, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if not line.lstrip().startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or cells[0] in ("layer", "") or set(cells[0]) <= set("-: "):
            continue  # the header and its separator
        rows.append((cells[0], re.findall(r"`([^`]+)`", cells[1])))
    assert rows, f"no layer table under {TABLE_HEADING!r} in {DOC}"
    return rows


def resolve_entry(entry: str, root: Path = REPO) -> Path | None:
    """A packages-column path: `specter/...`, `baselines/...` and top-level scripts from the repository root,
    any other (the engine row's `moe.py`, `offload/`, `projection/clock.py`) relative to specter/."""
    entry = entry.rstrip("/")
    if entry.split("/")[0] in TOPS:
        candidates = [root / entry]
    else:  # relative to specter/, else a script at the repository root (`run.py`)
        candidates = [root / "specter" / entry] + ([root / entry] if "/" not in entry else [])
    return next((c for c in candidates if c.exists()), None)


def rows_of_modules(text: str, root: Path = REPO) -> tuple[dict[str, int], list[str]]:
    """Each module file of specter/ and baselines/ (and each script the table names) -> the index of its row
    (the most specific path wins), and the table's problems (a path that names nothing, a path two rows claim,
    a module no row covers, a listed module that does not exist)."""
    rows, problems = layer_table(text), []
    claims: dict[Path, int] = {}
    for i, (layer, entries) in enumerate(rows):
        for entry in entries:
            path = resolve_entry(entry, root)
            if path is None:
                problems.append(f"{layer}: `{entry}` names no file or folder")
            elif path in claims and claims[path] != i:
                problems.append(f"`{entry}` is claimed by two rows: {rows[claims[path]][0]} and {layer}")
            else:
                claims[path] = i
    section = text.split(TABLE_HEADING, 1)[1].split("\n## ", 1)[0]
    for folder, listed in re.findall(r"`([\w/]+)/` \(([\w, ]+)\)", section):  # `specter/records/` (records, ...)
        for name in (n.strip() for n in listed.split(",")):
            if not ((root / folder / f"{name}.py").is_file() or (root / folder / name / "__init__.py").is_file()):
                problems.append(f"`{folder}/` lists {name}, which is no module there")
    placed: dict[str, int] = {}
    for mod, file in module_files(root).items():
        owners = [(len(p.parts), i) for p, i in claims.items() if file == p or p in file.parents]
        if owners:
            placed[mod] = max(owners)[1]
        elif mod.split(".")[0] in TOPS:
            problems.append(f"{file.relative_to(root)} is in no row of the layer table")
    return placed, problems


def layer_violations(text: str, graph: dict[str, set[str]], root: Path = REPO) -> list[str]:
    """`module (row) imports module (later row)` for every import the table's order forbids."""
    names = [layer for layer, _ in layer_table(text)]
    placed, _ = rows_of_modules(text, root)
    return sorted(f"{mod} ({names[placed[mod]]}) imports {dep} ({names[placed[dep]]})"
                  for mod, deps in graph.items() if mod in placed for dep in deps
                  if dep in placed and placed[dep] > placed[mod] and (mod, dep) not in ALLOWED)


def test_every_module_is_in_exactly_one_row():
    placed, problems = rows_of_modules(DOC.read_text())
    assert not problems, "docs/architecture.md's layer table:\n" + "\n".join(problems)
    assert "specter.moe" in placed and "baselines.common" in placed and "run" in placed


def test_the_stated_order_is_the_tables():
    """The sentence that states the layer order names the table's rows, in the table's order."""
    text = DOC.read_text()
    stated = re.search(r"Rows go from the bottom layer up: ([^.\n]+)\.", text)
    assert stated, "docs/architecture.md states no layer order ('Rows go from the bottom layer up: a < b < ...')"
    assert [s.strip() for s in stated.group(1).split("<")] == [layer for layer, _ in layer_table(text)]


def test_no_module_imports_a_later_row():
    """Rows go from the bottom layer up: a module imports only its own row and earlier ones."""
    violations = layer_violations(DOC.read_text(), import_graph())
    assert not violations, ("imports the layer table of docs/architecture.md forbids (move the module to the row "
                            "its imports justify):\n" + "\n".join(violations))


def test_allowed_exceptions_are_still_needed():
    graph = import_graph()
    stale = [f"{a} -> {b}" for a, b in ALLOWED if b not in graph.get(a, set())]
    assert not stale, f"ALLOWED lists imports that no longer exist: {stale}"


# ------------------------------------------------------------------------------------ the names
@lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _targets(node: ast.stmt) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def top_level(path: Path) -> dict[str, ast.stmt]:
    return {name: node for node in _tree(path).body for name in _targets(node)}


@lru_cache(maxsize=None)
def classes() -> dict[str, list[tuple[Path, ast.ClassDef]]]:
    """Class name -> where it is defined (every file of specter/ and baselines/)."""
    out: dict[str, list[tuple[Path, ast.ClassDef]]] = {}
    for path in module_files().values():
        for name, node in top_level(path).items():
            if isinstance(node, ast.ClassDef):
                out.setdefault(name, []).append((path, node))
    return out


def has_attr(cls: ast.ClassDef, attr: str, seen: frozenset[str] = frozenset()) -> bool:
    """`attr` is defined in the class body (a method, property or class attribute) or by a base class."""
    if any(attr in _targets(node) for node in cls.body):
        return True
    for base in cls.bases:
        name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
        if name and name not in seen and any(has_attr(c, attr, seen | {cls.name}) for _, c in classes().get(name, [])):
            return True
    return False


def resolve_file(ref: str) -> tuple[Path | None, str]:
    """A path the doc names: from the repository root or specter/; a bare file name is the one file of that
    name under specter/ and baselines/ (`engine.py`). Returns the file, or None and why."""
    for candidate in (REPO / ref, REPO / "specter" / ref):
        if candidate.is_file():
            return candidate, ""
    if "/" not in ref:
        hits = sorted(p for top in TOPS for p in (REPO / top).rglob(ref))
        if len(hits) == 1:
            return hits[0], ""
        if hits:
            return None, f"`{ref}` is ambiguous ({', '.join(str(h.relative_to(REPO)) for h in hits)})"
    return None, f"`{ref}` is no file"


def check_in_file(path: Path, name: str, attrs: list[str]) -> list[str]:
    where = path.relative_to(REPO)
    node = top_level(path).get(name)
    if node is None:
        return [f"{where} defines no {name}"]
    if attrs and not isinstance(node, ast.ClassDef):
        return [f"{where} {name} is no class, so it has no {', '.join(attrs)}"]
    return [f"{where} {name} has no {attr}" for attr in attrs if not has_attr(node, attr)]


def check_class(name: str, attrs: list[str]) -> list[str]:
    defs = classes().get(name)
    if not defs:
        return [f"no class {name} in specter/ or baselines/"]
    return [f"class {name} ({', '.join(str(p.relative_to(REPO)) for p, _ in defs)}) has no {attr}"
            for attr in attrs if not any(has_attr(node, attr) for _, node in defs)]


def check_dotted(dotted: str) -> list[str]:
    """`specter.routing_stats.held_out_routing`: the longest module prefix, then a name it defines."""
    modules = module_files()
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        mod = ".".join(parts[:cut])
        if mod in modules:
            rest = parts[cut:]
            return check_in_file(modules[mod], rest[0], rest[1:2]) if rest else []
    return [f"`{dotted}` names no module"]


IDENT = r"[A-Za-z_]\w*"
# `path.py`, `path.py name`, `path.py Class.method`, `path.py Class.a / b`; not `run.py key=value`
FILE_REF = re.compile(
    rf"(?<![\w/.<>-])((?:[\w-]+/)*\w+\.py)\b(?: ({IDENT})((?:\.{IDENT})?)((?: / {IDENT})*)(?![=\w]))?")
CLASS_REF = re.compile(rf"(?<![\w./])([A-Z]\w*)\.({IDENT})((?: / {IDENT})*)")  # `Class.method`, `Class.a / b`
DOTTED_REF = re.compile(r"(?<![\w./])(specter(?:\.\w+)+)")  # `specter.routing_stats.held_out_routing`
# A call on the left, its file alone in the note column: `expert_ffn      kernels/reference.py`,
# `ExpertCache.predict      offload/cache.py: ...` (a lowercase receiver, `drafter.step`, is an instance: skipped)
NOTED_CALL = re.compile(
    rf"^\s*({IDENT})(?:\.({IDENT}))?(?:\(.*?\))?\s{{3,}}((?:[\w-]+/)*\w+\.py)(?::|\s+\(|\s*$)")
KEYWORDS = ("for", "at", "with", "if", "limits")


def code_blocks(text: str) -> list[str]:
    """The doc's code blocks (indented by four spaces after a blank line, or fenced)."""
    blocks, current, fenced, previous = [], [], False, ""
    for line in text.splitlines():
        if line.startswith("```"):
            if fenced:
                blocks.append("\n".join(current))
                current = []
            fenced = not fenced
        elif fenced or (line.startswith("    ") and (current or not previous.strip())):
            current.append(line)
        elif current and line.strip():
            blocks.append("\n".join(current))
            current = []
        previous = line
    if current:
        blocks.append("\n".join(current))
    return blocks


def references(text: str) -> list[tuple[str, str]]:
    """(where, what) pairs: every code block line, and every inline `code` span of the prose."""
    found = [("code block", line) for block in code_blocks(text) for line in block.splitlines()]
    prose = "\n".join(line for line in text.splitlines() if not line.startswith("    "))
    found += [("prose", span) for span in re.findall(r"`([^`\n]+)`", prose)]
    return found


def missing_names(text: str) -> list[str]:
    """What the doc's call trees (and inline code) name that the code does not define."""
    problems = []
    for where, chunk in references(text):
        consumed: list[tuple[int, int]] = []
        for m in FILE_REF.finditer(chunk):
            path, why = resolve_file(m.group(1))
            consumed.append(m.span())
            if path is None:
                problems.append(f"{where}: {why} ({chunk.strip()!r})")
                continue
            name, attr, more = m.group(2), (m.group(3) or "").lstrip("."), re.findall(IDENT, m.group(4) or "")
            if name is None:
                continue  # a bare path (`predict/elb.py: top-M`, `(offload/cache.py, link.py)`)
            # `path.py Class.a / b`: methods of Class; `path.py f / g`: names the file defines. A word after a
            # path is read as a name, so prose after a path takes a colon (`kernels/select.py: the backend`).
            checks = check_in_file(path, name, [attr, *more]) if attr else [
                p for n in [name, *more] for p in check_in_file(path, n, [])]
            problems += [f"{where}: {p} ({chunk.strip()!r})" for p in checks]
        for m in CLASS_REF.finditer(chunk):
            if any(a <= m.start() < b for a, b in consumed):
                continue
            attrs = [m.group(2)] + re.findall(IDENT, m.group(3) or "")
            problems += [f"{where}: {p} ({chunk.strip()!r})" for p in check_class(m.group(1), attrs)]
        for m in DOTTED_REF.finditer(chunk):
            problems += [f"{where}: {p}" for p in check_dotted(m.group(1))]
        m = NOTED_CALL.match(chunk) if where == "code block" else None
        if m and m.group(1) not in KEYWORDS and not (m.group(2) and m.group(1)[0].islower()):
            path, why = resolve_file(m.group(3))
            found = [why] if path is None else check_in_file(path, m.group(1), [m.group(2)] if m.group(2) else [])
            problems += [f"{where}: {p} ({chunk.strip()!r})" for p in found]
    return list(dict.fromkeys(problems))


def test_the_call_trees_name_what_the_code_defines():
    problems = missing_names(DOC.read_text())
    assert not problems, "docs/architecture.md names what the code does not define:\n" + "\n".join(problems)


def test_the_call_trees_name_enough():
    """The check has something to check: the two call trees are found and name files and methods."""
    text = DOC.read_text()
    blocks = code_blocks(text)
    assert any("SpeculativeEngine._iterate" in b for b in blocks) and any("build_method" in b for b in blocks)
    refs = sum(len(FILE_REF.findall(b)) + len(CLASS_REF.findall(b)) for b in blocks)
    assert refs > 40, refs


# ------------------------------------------------------------------------------------ the checks can fail
def test_a_module_in_the_wrong_row_is_caught():
    """specter/api.py in the engine row: it imports assembly (a later row), so the check names it; a folder
    renamed in the table names nothing and leaves its modules in no row."""
    text = DOC.read_text()
    table = text.split(TABLE_HEADING, 1)[1].split("\n## ", 1)[0]
    moved = table.replace("`specter/api.py`, ", "").replace("| engine | `specter/models/`,",
                                                             "| engine | `specter/api.py`, `specter/models/`,")
    assert moved != table
    violations = layer_violations(text.replace(table, moved), import_graph())
    assert any(v.startswith("specter.api (engine) imports specter.assembly.") for v in violations), violations
    _, problems = rows_of_modules(text.replace("`specter/records/` (", "`specter/recordz/` ("))
    assert any("`specter/recordz/` names no file" in p for p in problems)
    assert any("specter/records/rowstore.py is in no row" in p for p in problems)


def test_a_wrong_name_is_caught():
    """A renamed function, a method its class lacks, a missing file and prose after a path are reported."""
    block = ("    x\n\n"
             "      assembly/methods.py build_methd ── assembly/compose.py compose\n"
             "      ExpertCache.prefetch / prefetsh\n"
             "      ELB.add                                       predict/elbb.py\n"
             "      moe.py MoERuntime.mode                        (kernels/select.py picks the backend)\n"
             "      `specter.routing_stats.held_out_routin`\n"
             "      expert_fn                                     kernels/reference.py\n"
             "      ExpertCache.predict                           predict/elb.py: the plan\n")
    problems = missing_names(block)
    for expected in ("specter/assembly/methods.py defines no build_methd",
                     "class ExpertCache (specter/offload/cache.py) has no prefetsh", "no class ELB",
                     "`predict/elbb.py` is no file", "specter/kernels/select.py defines no picks",
                     "defines no held_out_routin", "specter/kernels/reference.py defines no expert_fn",
                     "specter/predict/elb.py defines no ExpertCache"):
        assert any(expected in p for p in problems), (expected, problems)
    assert len(problems) == 8, problems  # no more: compose, MoERuntime.mode and prefetch are defined
