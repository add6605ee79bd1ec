"""The shipped reference set was measured by this checkout's code (specter/ and baselines/ trees)."""

from __future__ import annotations

import sys
from pathlib import Path

from specter.code_provenance import stale_folders

REPO = Path(__file__).resolve().parents[1]


def test_every_reference_folder_was_measured_at_heads_trees():
    stale = stale_folders(REPO / "results" / "reference", REPO)
    assert not stale, f"{len(stale)} folders measured by other code, e.g. {stale[:3]}"


def test_a_folder_measured_by_other_code_is_reported(tmp_path):
    import json
    import subprocess

    from specter.code_provenance import code_state

    repo = tmp_path / "repo"
    for tree in ("specter", "specter/figures", "baselines", "docs"):
        (repo / tree).mkdir(parents=True)
        (repo / tree / "a.py").write_text("x = 1\n")
    git = lambda *a: subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *a], cwd=repo,  # noqa: E731
                                    check=True, capture_output=True)
    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "one")
    results = tmp_path / "results"
    for name in ("same", "old", "dirty"):
        (results / name).mkdir(parents=True)
    state = code_state(repo)
    assert state["dirty"] == {"specter": False, "baselines": False}
    (results / "same" / "provenance.json").write_text(json.dumps({"code": [state]}))
    (results / "old" / "provenance.json").write_text(json.dumps({"code": [state]}))
    (repo / "docs" / "a.py").write_text("x = 2\n")  # a docs-only commit keeps the measuring code
    git("commit", "-qam", "docs")
    assert stale_folders(results, repo) == []
    (repo / "specter" / "a.py").write_text("x = 3\n")
    dirty = code_state(repo)
    assert dirty["dirty"]["specter"] and not dirty["dirty"]["baselines"]
    (results / "dirty" / "provenance.json").write_text(json.dumps({"code": [dirty]}))
    assert [(f.name, why) for f, why in stale_folders(results, repo)] == [
        ("dirty", f"measured at {dirty['commit'][:7]} with uncommitted changes in specter/")]
    git("commit", "-qam", "code")
    stale = {f.name: why for f, why in stale_folders(results, repo)}
    assert set(stale) == {"same", "old", "dirty"} and "specter/ differ from HEAD's" in stale["old"]
    (results / "none").mkdir()
    (results / "none" / "provenance.json").write_text("{}")
    assert dict((f.name, w) for f, w in stale_folders(results, repo))["none"] == "records no commit"


def test_files_no_provenance_covers_are_found(tmp_path):
    import json

    from specter.code_provenance import unrecorded_files

    for folder in ("run", "sweep/K=4", "bare", "run/sub"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "run" / "provenance.json").write_text(json.dumps({"code": []}))
    (tmp_path / "sweep" / "K=4" / "provenance.json").write_text(json.dumps({"code": []}))
    for f in ("run/records.csv", "run/sub/trace.csv.gz", "sweep/k_sweep.csv", "bare/projection.csv"):
        (tmp_path / f).write_text("a\n1\n")
    assert [p.relative_to(tmp_path).as_posix() for p in unrecorded_files(tmp_path)] == ["bare/projection.csv"]


def test_the_reference_set_names_what_carries_no_provenance():
    """Today the projection's CSVs carry none (its writer records no commit yet): the warning names them and
    nothing else; this list may only shrink."""
    from specter.code_provenance import unrecorded_files

    bare = {p.parent.parent.name for p in unrecorded_files(REPO / "results" / "reference")}
    assert bare <= {"project"}, bare


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in a file, function-level ones included, relative ones resolved."""
    import ast

    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names] + [(node.lineno, base)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("specter."):
            out.append((node.lineno, node.value))  # importlib.import_module("specter....")
    return out


def test_no_measuring_module_imports_the_code_the_digests_leave_out():
    """NOT_MEASURING is only true while no measurement can run its code: every import in the measuring
    trees (specter/ less those entries, baselines/) is checked. Two uses are the exceptions they must be:
    specter.load (the public entry in specter/__init__.py) imports the Python API when a user calls it, and
    the records writer asks code_provenance for the commit and trees it stores in provenance.json. Every
    command imports specter.entry (how it refuses input and stops on a signal), which is left out because
    it can reach no other code: it imports the standard library only."""
    from specter.code_provenance import NOT_MEASURING, TREES

    entry = [m for _, m in _imports(REPO / "specter/entry.py") if m.split(".")[0] != "__future__"]
    assert entry and all(m.split(".")[0] in sys.stdlib_module_names for m in entry), entry
    left_out = {x.removesuffix(".py").replace("/", ".") for x in NOT_MEASURING} - {"specter.entry"}
    allowed = {("specter/__init__.py", "specter.api"), ("specter/__init__.py", "specter.api.load"),
               ("specter/records/output.py", "specter.code_provenance"),
               ("specter/records/output.py", "specter.code_provenance.code_state"),
               ("specter/records/output.py", "specter.code_provenance.merged_states")}
    found = []
    for tree in TREES:
        for path in sorted((REPO / tree).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if any(rel == x or rel.startswith(x.removesuffix(".py") + "/") for x in NOT_MEASURING):
                continue
            for line, module in _imports(path):
                hit = next((m for m in left_out if module == m or module.startswith(m + ".")), None)
                if hit and (rel, module) not in allowed:
                    found.append(f"{rel}:{line} imports {module}")
    assert not found, found
    assert len(left_out) + 1 == len(NOT_MEASURING) and all((REPO / x).exists() for x in NOT_MEASURING)
