"""The shipped reference set was measured by this checkout's code (specter/ and baselines/ trees)."""

from __future__ import annotations

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
