"""SHA256SUMS as a manifest: every file it covers, so a changed, missing OR ADDED file fails.

    python scripts/checksums.py verify                 # the unpacked artifact: every file on disk listed
    python scripts/checksums.py verify --dir D         # the same for the folder D
    python scripts/checksums.py write --dir D          # D/SHA256SUMS over every file under D
    python scripts/checksums.py write --pinned         # the repository's SHA256SUMS: committed data files
    python scripts/checksums.py verify --pinned        #   under PINNED (a new file there, committed or
                                                       #   not, must be listed)

`sha256sum -c SHA256SUMS` checks the digests of the files listed, but says nothing about a file
that is not listed; `verify` also compares the list with the files present (artifact) or with the
committed files under the pinned folders (repository). Only the standard library is used, so it
runs in a bare Python before anything is installed. Exit status: 0 verified, 1 a mismatch, 2 bad use.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from pathlib import Path

SUMS = "SHA256SUMS"
REPO = Path(__file__).resolve().parents[1]
# the repository's pinned data: every committed file under these paths is listed in SHA256SUMS
PINNED = ("constraints.txt", "initialization/assets", "results/paper", "results/reference",
          "specter/models/tiny_checksums.json", "tests/fixtures/datasets")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_sums(path: Path) -> dict[str, str]:
    """name -> digest of a SHA256SUMS file (the `sha256sum` text format)."""
    out: dict[str, str] = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64 or not name:
            raise ValueError(f"{path} line {n} is not '<sha256>  <file>'")
        out[name] = digest
    return out


def format_sums(root: Path, names: list[str]) -> str:
    return "".join(f"{sha256(root / n)}  {n}\n" for n in sorted(names))


def tree_files(root: Path) -> list[str]:
    """Every file under `root` (links and other non-regular entries count as files too), but SHA256SUMS."""
    names = []
    for p in root.rglob("*"):
        if p.is_dir() and not p.is_symlink():
            continue
        rel = p.relative_to(root).as_posix()
        if rel != SUMS:
            names.append(rel)
    return sorted(names)


def pinned_files(repo: Path = REPO) -> list[str]:
    """The committed files under PINNED (git ls-files)."""
    res = subprocess.run(["git", "ls-files", "-z", "--", *PINNED], cwd=repo, capture_output=True)
    if res.returncode != 0:
        raise ValueError("git ls-files failed: " + res.stderr.decode(errors="replace").strip())
    return sorted(n for n in res.stdout.decode().split("\0") if n)


def on_disk(repo: Path = REPO) -> list[str]:
    """Every file present under PINNED, committed or not (relative to the checkout): a file dropped
    into a shipped tree is read by make_figures like any other, so it must be caught too."""
    names = []
    for entry in PINNED:
        path = repo / entry
        if path.is_dir() and not path.is_symlink():
            names += [f"{entry}/{n}" for n in tree_files(path) if not n.endswith(f"/{SUMS}")]
        elif path.exists() or path.is_symlink():
            names.append(entry)
    return sorted(names)


def problems(root: Path, listed: dict[str, str], expected: list[str], present: list[str] | None = None) -> list[str]:
    """What differs between SHA256SUMS, the files it should cover and their contents; `present`:
    the files on disk under the pinned folders, each of which must be committed and listed."""
    out = [f"added (not in {SUMS}): {n}" for n in sorted(set(expected) - set(listed))]
    out += [f"not committed (and not in {SUMS}): {n}" for n in sorted(set(present or ()) - set(expected) - set(listed))]
    for name, digest in sorted(listed.items()):
        path = root / name
        if not path.exists() and not path.is_symlink():
            out.append(f"missing: {name}")
        elif path.is_symlink() or not path.is_file():
            out.append(f"not a plain file: {name}")
        elif sha256(path) != digest:
            out.append(f"changed: {name}")
        elif name not in expected:
            out.append(f"listed but not committed under the pinned folders: {name}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/checksums.py", description=__doc__.split("\n\n")[0],
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=("verify", "write"))
    ap.add_argument("--dir", type=Path, default=None, help="the folder (default: the one holding scripts/)")
    ap.add_argument("--pinned", action="store_true",
                    help="the repository's SHA256SUMS: the committed files under " + ", ".join(PINNED))
    args = ap.parse_args(argv)
    root = (args.dir or REPO).resolve()
    if not root.is_dir():
        print(f"error: {root} is not a folder", file=sys.stderr)
        return 2
    if not args.pinned and (root / ".git").exists():
        print(f"error: {root} is a git checkout, whose {SUMS} pins only the committed data files: "
              "use --pinned (the file-list check without it is for an unpacked artifact)", file=sys.stderr)
        return 2
    try:
        expected = pinned_files(root) if args.pinned else tree_files(root)
        if args.action == "write":
            (root / SUMS).write_text(format_sums(root, expected), encoding="utf-8")
            print(f"wrote {root / SUMS}: {len(expected)} files")
            return 0
        listed = read_sums(root / SUMS)
    except FileNotFoundError:
        print(f"error: {root / SUMS} is missing", file=sys.stderr)
        return 1
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1 if args.action == "verify" else 2
    found = problems(root, listed, expected, on_disk(root) if args.pinned else None)
    for line in found:
        print(line, file=sys.stderr)
    if found:
        print(f"{SUMS}: {len(found)} problem(s) in {root}", file=sys.stderr)
        return 1
    what = "committed pinned files" if args.pinned else "files present"
    print(f"{SUMS}: {len(listed)} files verified; the list equals the {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
