"""The offline dataset bundle: small slices of the benchmark datasets, in their upstream formats.

`initialization/assets/` uses the assets layout `specter.datasets` reads
(`<name>/<upstream file name>`), so the harness can load prompts on a bare clone with no
hub and no network. Each slice is the head of the upstream file, byte for byte: the first
`records` lines (JSON lines) or the first `max_bytes` bytes cut at a line end (text). The
first prompts of a slice are therefore the first prompts of the full dataset; a seeded
sample (seed != 0) draws from the slice only, and records name the bundle as their source.

`MANIFEST.json` records, per dataset, the file, its sha256 and size, how many records it
holds, and the upstream repository, commit, path and sha256 it was cut from. LICENSES.md is
the attribution note. To rebuild the slices from upstream copies:

    python -m initialization.dataset_bundle --from-dir DIR     # DIR holds the upstream files
    python -m initialization.dataset_bundle --check            # sha256 of every bundled file

DIR is searched by upstream file name (test.jsonl, test.txt, HumanEval.jsonl.gz,
dataset.zip, c4-validation.00000-of-00008.json.gz). Datasets absent from DIR keep their
current slice (or stay absent). GPQA is copied whole and stays zipped, as its authors ask.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

BUNDLE_DIR = Path(__file__).resolve().parent / "assets"
MANIFEST = "MANIFEST.json"


@dataclass(frozen=True)
class Slice:
    """How one bundled file is cut from its upstream file."""

    name: str  # dataset name (specter.datasets.DATASETS)
    file: str  # path below BUNDLE_DIR/<name>/, an asset name the harness reads
    upstream_repo: str
    upstream_commit: str | None
    upstream_path: str  # path inside the upstream repository
    licence: str
    kind: str  # "jsonl" (first `records` lines), "jsonl.gz" (same, of the gunzipped file), "text", "copy"
    records: int = 0
    max_bytes: int = 0

    @property
    def upstream_name(self) -> str:
        return Path(self.upstream_path).name


SLICES: dict[str, Slice] = {
    "gsm8k": Slice(
        "gsm8k", "test.jsonl", "github.com/openai/grade-school-math", "3101c7d5072418e28b9008a6636bde82a006892c",
        "grade_school_math/data/test.jsonl", "MIT", "jsonl", records=100,
    ),
    "wikitext2": Slice(
        "wikitext2", "wiki.test.tokens", "github.com/pytorch/examples", "77f55b912142e11fcfdf5b530231fb9c52f181e8",
        "word_language_model/data/wikitext-2/test.txt", "CC BY-SA 3.0", "text", max_bytes=200_000,
    ),
    "humaneval": Slice(
        "humaneval", "HumanEval.jsonl", "github.com/openai/human-eval", "6d43fb980f9fee3c892a914eda09951f772ad10d",
        "data/HumanEval.jsonl.gz", "MIT", "jsonl.gz", records=100,
    ),
    "gpqa": Slice(
        "gpqa", "dataset.zip", "github.com/idavidrein/gpqa", None, "dataset.zip", "CC BY 4.0", "copy",
    ),
    "c4": Slice(
        "c4", "c4-validation.00000-of-00008.json.gz", "huggingface.co/datasets/allenai/c4", None,
        "en/c4-validation.00000-of-00008.json.gz", "ODC-BY 1.0", "jsonl.gz", records=100,
    ),
}


class BundleError(RuntimeError):
    """An upstream file cannot be cut into a slice, or a bundled file does not match the manifest."""


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def cut(spec: Slice, upstream: bytes) -> tuple[bytes, int]:
    """The bundled bytes cut from an upstream file, and how many records (lines) they hold."""
    if spec.kind == "copy":
        return upstream, 0
    if spec.kind == "jsonl.gz":
        upstream = gzip.decompress(upstream)
    if spec.kind in ("jsonl", "jsonl.gz"):
        lines = [ln for ln in upstream.splitlines(keepends=True) if ln.strip()][: spec.records]
        for i, line in enumerate(lines, 1):
            try:
                json.loads(line)
            except json.JSONDecodeError as exc:
                raise BundleError(f"{spec.upstream_name}: line {i} is not JSON ({exc.msg})") from exc
        body = b"".join(lines)
        if spec.file.endswith(".gz"):
            body = gzip.compress(body, mtime=0)  # mtime 0: the same bytes on every rebuild
        return body, len(lines)
    if spec.kind == "text":
        head = upstream[: spec.max_bytes]
        end = head.rfind(b"\n") + 1 if len(upstream) > spec.max_bytes else len(head)
        if end <= 0:
            raise BundleError(f"{spec.upstream_name}: no line end in the first {spec.max_bytes} bytes")
        body = head[:end]
        return body, body.count(b"\n")
    raise BundleError(f"unknown slice kind {spec.kind!r}")


def build(from_dir: Path, bundle: Path = BUNDLE_DIR) -> list[str]:
    """Cut every slice whose upstream file is in from_dir; update the manifest. Returns the names cut."""
    manifest = read_manifest(bundle)
    done = []
    for name, spec in SLICES.items():
        found = sorted(p for p in Path(from_dir).rglob(spec.upstream_name) if p.is_file())
        if not found:
            continue
        upstream = found[0].read_bytes()
        body, records = cut(spec, upstream)
        dest = bundle / name / spec.file
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(body)
        manifest[name] = {
            "file": f"{name}/{spec.file}",
            "sha256": sha256_bytes(body),
            "bytes": len(body),
            "records": records,
            "licence": spec.licence,
            "upstream": {"repository": spec.upstream_repo, "commit": spec.upstream_commit,
                         "path": spec.upstream_path, "sha256": sha256_bytes(upstream), "bytes": len(upstream)},
        }
        done.append(name)
    (bundle / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return done


def read_manifest(bundle: Path = BUNDLE_DIR) -> dict[str, dict]:
    path = Path(bundle) / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else {}


def check(bundle: Path = BUNDLE_DIR) -> list[str]:
    """Problems with the bundle (files missing or changed against the manifest); empty when sound."""
    problems = []
    for name, entry in read_manifest(bundle).items():
        path = Path(bundle) / entry["file"]
        if not path.is_file():
            problems.append(f"{name}: {path} is missing")
        elif sha256_bytes(path.read_bytes()) != entry["sha256"]:
            problems.append(f"{name}: {path} does not match its sha256 in {MANIFEST}")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m initialization.dataset_bundle", description=__doc__.split("\n\n")[0])
    parser.add_argument("--from-dir", metavar="DIR", help="cut slices from the upstream files found in DIR")
    parser.add_argument("--check", action="store_true", help="verify every bundled file against the manifest")
    args = parser.parse_args(argv)
    if args.from_dir is None and not args.check:
        parser.print_usage(sys.stderr)
        print("error: give --from-dir DIR or --check", file=sys.stderr)
        return 2
    if args.from_dir is not None:
        if not Path(args.from_dir).is_dir():
            print(f"error: --from-dir {args.from_dir} is not a folder", file=sys.stderr)
            return 2
        try:
            done = build(Path(args.from_dir))
        except BundleError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print("cut: " + (", ".join(done) or "nothing (no upstream file found)"))
    problems = check()
    for problem in problems:
        print(f"FAILED {problem}", file=sys.stderr)
    missing = [n for n in SLICES if n not in read_manifest()]
    if missing:
        print("not bundled: " + ", ".join(missing))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
