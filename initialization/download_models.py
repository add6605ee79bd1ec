"""Download the real models' weights, pinned to a recorded revision and verified file by file.

    python initialization/download_models.py dsv2                  # DeepSeek-V2-Lite
    python initialization/download_models.py qwen15moe phi35moe --dest /data/models
    python initialization/download_models.py dsv2 --verify-only    # check a folder in place
    python initialization/download_models.py dsv2 --source /mnt/hub-mirror   # no network: a local mirror
    python initialization/download_models.py dsv2 --update         # move to the hub's current revision

Weights go to `<dest>/<folder>` (dest: $SPECTER_MODELS or ./models, where the model configs look).
The first download resolves the revision (the model config's `revision`, else `main`) to a commit
and records, in `initialization/model-revisions.json`, the commit and every file's size and
sha256. Every later download fetches that same commit and checks every file against the record;
`--update` moves the record to the hub's current commit.

Resumable: a file is fetched into `<file>.part` and completed from where it stopped; a finished
file is re-hashed only when its size or mtime changed since it was last verified (the stamp is
`<folder>/.specter-verified.json`). A file whose bytes do not match is fetched again once, then
reported. `<folder>/SHA256SUMS` lets `sha256sum -c SHA256SUMS` check the folder by hand.

--source DIR (or $SPECTER_HUB_SOURCE) replaces the hub with a local folder in the Hugging Face
cache layout: `DIR/models--<org>--<name>/refs/<branch>` holds a commit id and
`DIR/models--<org>--<name>/snapshots/<commit>/` the files (e.g. a copy of ~/.cache/huggingface/hub).
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MANIFEST = Path(__file__).with_name("model-revisions.json")
REAL_MODELS = ("dsv2", "qwen15moe", "phi35moe")
PATTERNS = ("*.json", "*.safetensors", "*.model", "*.py", "*.txt", "*.tiktoken")
STAMP = ".specter-verified.json"
CHUNK = 1 << 24


class DownloadError(Exception):
    """A user-facing failure: the message says what to do."""


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int | None
    sha256: str | None  # known for LFS files on the hub; None: recorded on first download


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def wanted(path: str) -> bool:
    return any(fnmatch.fnmatch(Path(path).name, p) for p in PATTERNS)


# ---------------------------------------------------------------- sources


class LocalMirror:
    """A folder in the Hugging Face cache layout, standing in for the hub (kind: models | datasets)."""

    def __init__(self, root: Path, kind: str = "models"):
        self.root = Path(root)
        self.kind = kind

    def _repo(self, repo_id: str) -> Path:
        path = self.root / (f"{self.kind}--" + repo_id.replace("/", "--"))
        if not path.is_dir():
            raise DownloadError(f"{repo_id} is not in the mirror {self.root} (expected {path})")
        return path

    def resolve(self, repo_id: str, revision: str) -> str:
        repo = self._repo(repo_id)
        if (repo / "snapshots" / revision).is_dir():
            return revision
        ref = repo / "refs" / revision
        if not ref.is_file():
            raise DownloadError(f"revision {revision!r} of {repo_id} is not in the mirror {self.root}")
        return ref.read_text().strip()

    def files(self, repo_id: str, commit: str) -> list[RemoteFile]:
        snap = self._repo(repo_id) / "snapshots" / commit
        if not snap.is_dir():
            raise DownloadError(f"commit {commit} of {repo_id} is not in the mirror {self.root}")
        return [RemoteFile(str(p.relative_to(snap)), p.stat().st_size, None)
                for p in sorted(snap.rglob("*")) if p.is_file()]

    def fetch(self, repo_id: str, commit: str, path: str, part: Path) -> None:
        src = self._repo(repo_id) / "snapshots" / commit / path
        offset = part.stat().st_size if part.exists() else 0
        if offset:
            print(f"  {path}: resuming at {offset} bytes")
        with src.open("rb") as fin, part.open("ab") as fout:
            fin.seek(offset)
            shutil.copyfileobj(fin, fout, CHUNK)


class Hub:
    """The Hugging Face hub through huggingface_hub (which resumes interrupted files itself)."""

    def __init__(self):
        try:
            from huggingface_hub import HfApi
        except ImportError as exc:
            raise DownloadError("huggingface_hub is not installed (pip install -e .)") from exc
        self.api = HfApi()

    def resolve(self, repo_id: str, revision: str) -> str:
        return self.api.model_info(repo_id, revision=revision).sha

    def files(self, repo_id: str, commit: str) -> list[RemoteFile]:
        info = self.api.model_info(repo_id, revision=commit, files_metadata=True)
        return [RemoteFile(s.rfilename, s.size, (s.lfs or {}).get("sha256") if isinstance(s.lfs, dict)
                           else getattr(s.lfs, "sha256", None)) for s in info.siblings]

    def fetch(self, repo_id: str, commit: str, path: str, part: Path) -> None:
        from huggingface_hub import hf_hub_download

        with tempfile.TemporaryDirectory(dir=part.parent) as tmp:
            got = hf_hub_download(repo_id, path, revision=commit, local_dir=tmp)
            os.replace(got, part)


# ---------------------------------------------------------------- one model


def load_manifest(path: Path) -> dict:
    data = json.loads(path.read_text()) if path.exists() else {}
    return {k: (v if isinstance(v, dict) else {"revision": v}) for k, v in data.items()}  # old format: name -> sha


def save_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


class Folder:
    """The local copy: verification with a stamp so unchanged files are not hashed again."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        stamp = self.root / STAMP
        self.stamp: dict = json.loads(stamp.read_text()) if stamp.exists() else {}

    def digest(self, rel: str) -> str | None:
        path = self.root / rel
        if not path.is_file():
            return None
        st = path.stat()
        known = self.stamp.get(rel)
        if known and known["size"] == st.st_size and known["mtime_ns"] == st.st_mtime_ns:
            return known["sha256"]
        digest = sha256_file(path)
        self.stamp[rel] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
        return digest

    def save(self, files: dict[str, dict]) -> None:
        save_json(self.root / STAMP, self.stamp)
        (self.root / "SHA256SUMS").write_text("".join(f"{f['sha256']}  {rel}\n" for rel, f in sorted(files.items())))


def download(name: str, repo_id: str, folder: Path, source, manifest: dict, revision: str | None,
             update: bool) -> dict:
    entry = manifest.get(name, {})
    if entry.get("revision") and not update and not revision:
        commit = entry["revision"]  # pinned: the same bytes as every earlier download
    else:
        commit = source.resolve(repo_id, revision or "main")
        if entry.get("revision") and entry["revision"] != commit:
            print(f"{name}: moving from recorded revision {entry['revision']} to {commit}")
            entry = {}
    recorded = entry.get("files", {})
    remote = [f for f in source.files(repo_id, commit) if wanted(f.path)]
    if not remote:
        raise DownloadError(f"{repo_id}@{commit} holds no weight or config files")
    local = Folder(folder)
    files: dict[str, dict] = {}
    for rf in remote:
        expected = recorded.get(rf.path, {}).get("sha256") or rf.sha256
        dest = local.root / rf.path
        if expected and local.digest(rf.path) == expected:
            files[rf.path] = {"size": dest.stat().st_size, "sha256": expected}
            continue
        digest = None
        for attempt in (1, 2):
            part = dest.with_name(dest.name + ".part")
            part.parent.mkdir(parents=True, exist_ok=True)
            if dest.exists():
                dest.unlink()
            source.fetch(repo_id, commit, rf.path, part)
            digest = sha256_file(part)
            if expected is None or digest == expected:
                os.replace(part, dest)
                break
            print(f"  {rf.path}: sha256 {digest[:12]}… does not match the recorded {expected[:12]}…"
                  + ("; fetching it again" if attempt == 1 else ""))
            part.unlink()
        else:
            raise DownloadError(f"{repo_id}@{commit}: {rf.path} does not match its recorded sha256 {expected} "
                                f"(got {digest}); the source changed or is corrupt")
        local.stamp.pop(rf.path, None)
        files[rf.path] = {"size": dest.stat().st_size, "sha256": local.digest(rf.path)}
        print(f"  {rf.path}: {files[rf.path]['size']} bytes, verified")
    local.save(files)
    return {"hf_id": repo_id, "revision": commit, "files": files}


def verify_only(name: str, folder: Path, manifest: dict) -> list[str]:
    entry = manifest.get(name)
    if not entry or not entry.get("files"):
        raise DownloadError(f"no recorded files for {name} in the manifest; download it first")
    local = Folder(folder)
    bad = [rel for rel, f in sorted(entry["files"].items()) if local.digest(rel) != f["sha256"]]
    save_json(local.root / STAMP, local.stamp)
    return bad


def model_repo(name: str) -> tuple[str, str, str | None]:
    """(hub id, folder name, configured revision) of a real model, from conf/model/<name>.yaml."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(REPO / "conf" / "model" / f"{name}.yaml")
    folder = str(cfg.get("local_dir") or cfg.hf_id).rstrip("/").split("/")[-1]
    return str(cfg.hf_id), folder, cfg.get("revision")


def main(argv: list[str] | None = None) -> int:
    doc = __doc__.split("\n\n")
    ap = argparse.ArgumentParser(description=doc[0], epilog="\n\n".join(doc[1:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", help=f"model configs to fetch: {', '.join(REAL_MODELS)}")
    ap.add_argument("--repo", help="a hub repository (org/name) instead of a model config; its record key is --name")
    ap.add_argument("--name", help="record key for --repo (default: the repository's name)")
    ap.add_argument("--dest", default=os.environ.get("SPECTER_MODELS", "models"), help="parent folder")
    ap.add_argument("--source", default=os.environ.get("SPECTER_HUB_SOURCE"),
                    help="a local mirror in the hub-cache layout instead of the hub")
    ap.add_argument("--manifest", type=Path, default=MANIFEST, help="the record of revisions and checksums")
    ap.add_argument("--revision", help="branch, tag or commit to fetch (moves the record)")
    ap.add_argument("--update", action="store_true", help="move the record to the source's current revision")
    ap.add_argument("--verify-only", action="store_true", help="check the local files against the record")
    args = ap.parse_args(argv)
    targets: list[tuple[str, str, str, str | None]] = []
    for name in args.models:
        if name not in REAL_MODELS:
            ap.error(f"unknown model {name!r}; choose from {', '.join(REAL_MODELS)} (or use --repo)")
        targets.append((name, *model_repo(name)))
    if args.repo:
        targets.append((args.name or args.repo.split("/")[-1], args.repo, args.repo.split("/")[-1], None))
    if not targets:
        ap.error("name a model (dsv2, qwen15moe, phi35moe) or --repo")
    manifest = load_manifest(args.manifest)
    status = 0
    for name, repo_id, folder_name, configured in targets:
        folder = Path(args.dest) / folder_name
        try:
            if args.verify_only:
                bad = verify_only(name, folder, manifest)
                if bad:
                    print(f"error: {folder}: {len(bad)} file(s) missing or changed: {', '.join(bad)}; rerun "
                          f"without --verify-only to fetch them again", file=sys.stderr)
                    status = 1
                else:
                    print(f"{name}: {folder} matches {manifest[name]['revision']} ({len(manifest[name]['files'])} files)")
                continue
            source = LocalMirror(Path(args.source)) if args.source else Hub()
            print(f"{name}: {repo_id} -> {folder}{' (from ' + args.source + ')' if args.source else ''}")
            manifest[name] = download(name, repo_id, folder, source, manifest, args.revision or configured, args.update)
            save_json(args.manifest, manifest)
            print(f"{name}: {repo_id}@{manifest[name]['revision']}: {len(manifest[name]['files'])} files verified")
        except DownloadError as err:
            print(f"error: {name}: {err}", file=sys.stderr)
            status = 2
        except Exception as err:  # noqa: BLE001 - offline, gated, disk full: one clear line
            print(f"error: could not download {repo_id}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
                  file=sys.stderr)
            print("  This needs the Hugging Face hub (or --source DIR, a local mirror). On CPU-only machines use "
                  "model=tiny_dsv2 / tiny_qwen / tiny_phi instead.", file=sys.stderr)
            status = 2
    return status


if __name__ == "__main__":
    raise SystemExit(main())
