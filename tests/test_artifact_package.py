"""scripts/package_artifact.sh: build into tmp, unpack, verify every checksum, draw figures without torch."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from test_figures import make_results

REPO = Path(__file__).resolve().parents[1]
NO_TORCH = (
    "import runpy, sys; sys.modules['torch'] = None; "  # any `import torch` now fails
    "sys.argv = ['make_figures.py', '--results', 'results/reference', '--figures', sys.argv[1], '--dpi', '50']; "
    "runpy.run_path('make_figures.py', run_name='__main__')"
)


def _committed(path: str) -> bool:
    return subprocess.run(["git", "cat-file", "-e", f"HEAD:{path}"], cwd=REPO, capture_output=True).returncode == 0


@pytest.mark.skipif(not (REPO / ".git").exists(), reason="needs the git repository")
def test_package_builds_verifies_and_draws(tmp_path):
    if not all(_committed(p) for p in ("ARTIFACT.md", "CITATION.cff", ".zenodo.json", "make_figures.py")):
        pytest.fail("ARTIFACT.md, CITATION.cff, .zenodo.json and make_figures.py must be committed")
    reference = make_results(tmp_path / "reference")
    env = dict(os.environ, OUT=str(tmp_path / "dist"), REFERENCE=str(reference), PYTHON=sys.executable)
    res = subprocess.run(["bash", str(REPO / "scripts" / "package_artifact.sh")], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    tarballs = list((tmp_path / "dist").glob("specter-artifact-*.tar.gz"))
    assert len(tarballs) == 1
    tarball = tarballs[0]
    name = tarball.name[: -len(".tar.gz")]
    assert len(name.rsplit("-", 1)[1]) == 12  # the short commit sha
    check = subprocess.run(["sha256sum", "-c", f"{name}.tar.gz.sha256"], cwd=tmp_path / "dist", capture_output=True)
    assert check.returncode == 0
    with tarfile.open(tarball) as tar:
        assert {m.name.split("/")[0] for m in tar.getmembers()} == {name}
        tar.extractall(tmp_path / "unpacked", filter="data")
    root = tmp_path / "unpacked" / name
    verify = subprocess.run(["sha256sum", "-c", "--strict", "SHA256SUMS"], cwd=root, capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout[-2000:] + verify.stderr[-2000:]
    listed = {line.split("  ", 1)[1] for line in (root / "SHA256SUMS").read_text().splitlines()}
    on_disk = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()} - {"SHA256SUMS"}
    assert listed == on_disk  # every file, and nothing else
    manifest = [sys.executable, "scripts/checksums.py", "verify"]
    ok = subprocess.run(manifest, cwd=root, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    for path in ("ARTIFACT.md", "CITATION.cff", ".zenodo.json", "make_figures.py", "run.py",
                 "results/paper/claims.csv", "results/reference/main/tiny_dsv2-specter-high/records.csv",
                 "results/reference/main/tiny_dsv2-specter-high/config.yaml", "figures/reference/fig14_tpot.png",
                 "figures/reference/fig14_tpot.csv", "figures/reference/index.md"):
        assert (root / path).is_file(), path
    # figures from the unpacked copy alone, with torch unavailable
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    drawn = subprocess.run([sys.executable, "-c", NO_TORCH, str(tmp_path / "figs")], cwd=root, env=clean,
                           capture_output=True, text=True, timeout=300)
    assert drawn.returncode == 0, drawn.stdout[-2000:] + drawn.stderr[-2000:]
    assert (tmp_path / "figs" / "fig14_tpot.pdf").exists() and (tmp_path / "figs" / "paper_vs_here.md").exists()
    assert "FAILED" not in drawn.stdout
    which = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, '.'); import specter.figures as f; "
                            "print(f.__file__)"], cwd=root, env=clean, capture_output=True, text=True)
    assert which.stdout.strip().startswith(str(root))


def _verify(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "checksums.py"), "verify", "--dir", str(root)],
                          capture_output=True, text=True)


def test_manifest_catches_added_changed_and_missing_files(tmp_path):
    """SHA256SUMS lists every file: `sha256sum -c` misses an added file, the manifest check does not."""
    root = tmp_path / "artifact"
    (root / "results").mkdir(parents=True)
    (root / "run.py").write_text("print('run')\n")
    (root / "results" / "records.csv").write_text("a,b\n1,2\n")
    made = subprocess.run([sys.executable, str(REPO / "scripts" / "checksums.py"), "write", "--dir", str(root)],
                          capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    assert _verify(root).returncode == 0
    (root / "results" / "extra.py").write_text("import os\n")  # an added file
    assert subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=root).returncode == 0  # not caught
    added = _verify(root)
    assert added.returncode == 1 and "added (not in SHA256SUMS): results/extra.py" in added.stderr
    (root / "results" / "extra.py").unlink()
    (root / "run.py").write_text("print('changed')\n")
    changed = _verify(root)
    assert changed.returncode == 1 and "changed: run.py" in changed.stderr
    (root / "run.py").unlink()
    missing = _verify(root)
    assert missing.returncode == 1 and "missing: run.py" in missing.stderr
