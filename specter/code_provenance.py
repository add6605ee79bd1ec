"""Which code measured a result folder: the commit, and digests of the trees of specter/ and baselines/.

A commit alone does not say whether two folders ran the same measuring code (a README edit is a new
commit); the trees of specter/ and baselines/ do: a tree's digest is the sha256 of its git listing
(`git ls-tree <commit> specter/`: every entry's object id, so everything under it), less the entries
of `NOT_MEASURING`: code that never changes a record (tests/test_reference_provenance.py checks that
no measuring module imports it, bar the records writer's call here and specter/entry.py): specter/figures/
draws CSVs; the entry points for use (specter generate, specter serve, specter.load) answer users;
specter/entry.py, the refusal and signal rule every command runs under, decides how a command ends and
imports only the standard library (that test checks it too); this module writes provenance.json's `code`
and never a record.
A run records, in its provenance.json (`code`), the commit it ran at, both trees, and per tree whether
the working copy differed from that commit (`dirty`: then the tree digest is the commit's, and the code
that ran was something else); a recorded commit this clone holds is judged by today's NOT_MEASURING.
`make_figures.py` warns about every folder whose trees are not HEAD's (`stale_folders`). Plain git, no
torch: figures need none.
"""

from __future__ import annotations

import functools
import hashlib
import json
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TREES = ("specter", "baselines")  # the code that measures; docs, configs and figures do not change a record
NOT_MEASURING = ("specter/figures", "specter/serve", "specter/api.py", "specter/cli.py",  # left out of the digests
                 "specter/entry.py", "specter/code_provenance.py", "specter/scheduler.py")
PROVENANCE_NAME = "provenance.json"


def _git(repo: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def tree_digests(commit: str, repo: Path = REPO) -> dict[str, str | None]:
    """{tree: the digest of its measuring entries at `commit`} (None: no such commit or tree in this clone)."""
    out: dict[str, str | None] = {}
    for t in TREES:
        listing = _git(repo, "ls-tree", commit, f"{t}/")
        if not listing:
            out[t] = None
            continue
        kept = [line for line in listing.splitlines() if line.split("\t", 1)[-1] not in NOT_MEASURING]
        out[t] = hashlib.sha256("\n".join(kept).encode()).hexdigest()
    return out


def code_state(repo: Path = REPO) -> dict[str, Any] | None:
    """What a run records: {"commit", "trees": {tree: sha}, "dirty": {tree: bool}}; None outside git."""
    commit = _git(repo, "rev-parse", "HEAD")
    if not commit:
        return None
    dirty = {}
    for t in TREES:
        changed = _git(repo, "status", "--porcelain", "--untracked-files=normal", "--", t,
                       *(f":(exclude){x}" for x in NOT_MEASURING if x.startswith(f"{t}/")))
        dirty[t] = None if changed is None else bool(changed)
    return {"commit": commit, "trees": tree_digests(commit, repo), "dirty": dirty}


def recorded_states(folder: Path, repo: Path = REPO) -> list[dict[str, Any]]:
    """The code states a folder's records were measured under: provenance.json's `code` list, else (an
    older folder) the commit of each env*.json (`git_sha`) with its trees looked up in this clone."""
    folder = Path(folder)
    try:
        data = json.loads((folder / PROVENANCE_NAME).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        data = {}
    states = data.get("code") if isinstance(data, dict) else None
    if isinstance(states, list) and states:
        return [s for s in states if isinstance(s, dict)]
    out = []
    for env in sorted(folder.glob("env*.json")):
        try:
            sha = json.loads(env.read_text(encoding="utf-8")).get("git_sha")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            sha = None
        if isinstance(sha, str) and sha:
            out.append({"commit": sha, "trees": tree_digests(sha, repo), "dirty": {}})
    return out


def merged_states(previous: Any, now: dict[str, Any] | None) -> list[dict[str, Any]]:
    """provenance.json's `code` after a start: every distinct state its records were measured under."""
    states = [s for s in previous if isinstance(s, dict)] if isinstance(previous, list) else []
    if now is not None and now not in states:
        states.append(now)
    return states


def why_stale(states: list[dict[str, Any]], head: dict[str, str | None], repo: Path = REPO) -> str | None:
    """Why a folder's code is not HEAD's (None: every state's trees are HEAD's, none dirty)."""
    if not states:
        return "records no commit"
    for s in states:
        commit = str(s.get("commit") or "?")[:7]
        trees = _trees_now(s, repo)
        differ = [t for t in TREES if trees.get(t) != head.get(t)]
        if differ:
            unknown = [t for t in differ if trees.get(t) is None]
            what = "unknown here" if unknown == differ else "differ from HEAD's"
            return f"measured at {commit}: {' and '.join(f'{t}/' for t in differ)} {what}"
        dirty = [t for t in TREES if (s.get("dirty") or {}).get(t)]
        if dirty:
            return f"measured at {commit} with uncommitted changes in {' and '.join(f'{t}/' for t in dirty)}"
    return None


@functools.lru_cache(maxsize=256)
def _digests_at(commit: str, repo: str) -> dict[str, str | None]:
    return tree_digests(commit, Path(repo))  # a reference set's hundreds of folders share a few commits


def _trees_now(state: dict[str, Any], repo: Path = REPO) -> dict[str, Any]:
    """A state's tree digests by today's NOT_MEASURING: recomputed from its commit where this clone holds
    it (a digest recorded before an entry joined NOT_MEASURING counts that entry), else as recorded."""
    commit = state.get("commit")
    if isinstance(commit, str) and commit:
        now = _digests_at(commit, str(repo))
        if all(now.values()):
            return now
    return state.get("trees") or {}


def stale_folders(root: Path, repo: Path = REPO) -> list[tuple[Path, str]]:
    """(run folder, why) for every folder under `root` holding a run (provenance.json) whose code is not
    HEAD's. A sweep's per-K or per-B folders are reported once, through their enclosing run folder."""
    head = tree_digests("HEAD", repo)
    out: dict[Path, str] = {}
    for path in sorted(Path(root).rglob(PROVENANCE_NAME)):
        run = _run_folder(path.parent)
        if run in out:
            continue
        why = why_stale(recorded_states(path.parent, repo), head, repo)
        if why:
            out[run] = why
    return sorted(out.items())


def _run_folder(folder: Path) -> Path:
    """A sweep point's folder (K=<k>, B=<b>, r=<r> below a run) stands for its enclosing run."""
    parts = folder.parts
    cut = next((i for i, p in enumerate(parts) if p.startswith(("K=", "B=", "r="))), len(parts))
    return Path(*parts[:cut]) if cut else folder


def unrecorded_files(root: Path) -> list[Path]:
    """Result files (CSV, gzipped CSV) under `root` that no provenance.json covers: none in their folder or an
    enclosing one up to `root`, and none below their folder (a sweep's summary stands on its points' records).
    Their code cannot be checked against HEAD's: they carry no commit or digest."""
    root = Path(root)
    out = []
    for path in sorted([*root.rglob("*.csv"), *root.rglob("*.csv.gz")]):
        folder = path.parent
        if any(folder.rglob(PROVENANCE_NAME)):
            continue
        up = folder
        while up != root and up != up.parent and not (up / PROVENANCE_NAME).exists():
            up = up.parent
        if not (up / PROVENANCE_NAME).exists():
            out.append(path)
    return out
