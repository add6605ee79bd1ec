"""Result folders: one writer at a time, never overwrite a finished record, resume safely.

A run holds an exclusive lock on its folder (`.specter.lock`, holding the writer's pid) for its
whole lifetime, so two runs never interleave records; the lock dies with the process, so a
killed run never leaves the folder locked. The lock is taken before any other check, so a second
run is always refused naming the first one's pid. Row tables (records.csv, batch.csv, routes.csv,
trace.csv) are appended through the validated row store (specter/records/rowstore.py); every
other file is written atomically (temp file, fsync, rename).

Resuming is allowed only for the same run: the same configuration (`config.yaml`, up to
`VOLATILE_KEYS`), the same prompts (`provenance.json`: per dataset the source file, its sha256
and the prompt-set hash) and the same weights (their digest). A folder without a finished
record belongs to no measurement yet, so it takes a corrected configuration (a start that
failed on a budget, a missing GPU or a corrupt file does not lock the folder to its mistake).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from specter.code_provenance import code_state, merged_states
from specter.assembly.config import ConfigError
from specter.records.records import parse_records, text_digest
from specter.paths import atomic_write_text, read_json_object

# May differ between resumed runs: they change neither what is measured nor how.
VOLATILE_KEYS = ("progress", "verbose", "output_dir", "allow_hub", "assets_dir", "hardware.recalibrate",
                "hardware.retime_per_record")
PACKAGES = ("torch", "transformers", "gptqmodel", "hydra-core", "safetensors", "tokenizers", "datasets", "numpy")
LOCK_NAME = ".specter.lock"
PROVENANCE_NAME = "provenance.json"


class OutputError(ConfigError):
    """The output folder cannot be used (unwritable, not a folder, locked by another run)."""


def comparable(cfg: DictConfig) -> dict[str, Any]:
    data = OmegaConf.to_container(cfg, resolve=True)
    for key in VOLATILE_KEYS:
        node, *rest = key.split(".")
        if rest and isinstance(data.get(node), dict):
            data[node].pop(rest[0], None)
        elif not rest:
            data.pop(key, None)
    data.pop("hydra", None)
    return data


def _differences(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(a) | set(b), key=str):
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            out += _differences(x, y, f"{prefix}{k}.")
        elif x != y:
            out.append(f"{prefix}{k}")
    return out


def finished_records(out: Path) -> int:
    """Finished records in `out/records.csv` (read only; torn or invalid rows do not count)."""
    try:
        text = (out / "records.csv").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return 0
    return len(parse_records(text)[1])


def _os_error(out: Path, err: OSError) -> OutputError:
    reason = err.strerror or str(err)
    if isinstance(err, NotADirectoryError) or err.errno == errno.ENOTDIR:
        reason = "a part of that path is a file, not a folder"
    return OutputError(f"cannot use output_dir={out}: {reason}")


def _lock(out: Path) -> int:
    """Take the folder's exclusive lock (non-blocking) and write our pid into the lock file."""
    path = out / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise _os_error(out, err) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise OutputError(f"output_dir={out} is in use by another run (pid {holder}); wait for it to finish "
                          "or choose another output_dir") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as err:
        os.close(fd)
        raise _os_error(out, err) from None
    return fd


def _sha256_of(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _check_written(out: Path, finished: int) -> None:
    """A folder with finished records is resumed only on the files this code wrote: config.yaml and
    every env*.json must still hold the bytes whose sha256 provenance.json recorded (a hand edit, or a
    half-written copy, would make the resumed records mean something else), and every env*.json must
    be a whole JSON object."""
    if not finished:
        return
    recorded = read_provenance(out)
    written = {"config.yaml": recorded.get("config_sha256"), **(recorded.get("env_sha256") or {})}
    for name, digest in sorted(written.items()):
        path = out / name
        if isinstance(digest, str) and path.exists() and _sha256_of(path) != digest:
            raise OutputError(f"{path} was changed after the run wrote it (sha256 {str(_sha256_of(path))[:12]}, "
                              f"written {digest[:12]}): {out} holds {finished} finished records that it no longer "
                              "describes; restore the file, or choose another output_dir")
    for path in sorted(out.glob("env*.json")):
        try:
            ok = isinstance(json.loads(path.read_text(encoding="utf-8")), dict)
        except (OSError, UnicodeDecodeError, ValueError):
            ok = False
        if not ok:
            raise OutputError(f"{path} is damaged (not a whole JSON object), so resuming cannot check the "
                              f"environment of the {finished} finished records: choose another output_dir")


# env.json keys that change what a timed record means: another machine or other library versions
# make the resumed records a different measurement.
ENVIRONMENT_KEYS = ("packages", "python", "cpu.processor", "cpu.count", "gpu")


def _env_value(data: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        data = data.get(part) if isinstance(data, dict) else None
    return data


def check_environment(out: Path, finished: int, now: dict[str, Any] | None = None) -> None:
    """The first env.json of a folder with finished records must describe this machine and these
    libraries (ENVIRONMENT_KEYS); any difference is refused, naming the keys."""
    path = out / "env.json"
    if not finished or not path.exists():
        return
    was = read_json_object(path)
    now = environment_info() if now is None else now
    changed = []
    for key in ENVIRONMENT_KEYS:
        a, b = _env_value(was, key), _env_value(now, key)
        if isinstance(a, dict) and isinstance(b, dict):
            changed += [f"{key}.{k}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        elif a != b:
            changed.append(key)
    if changed:
        raise ConfigError(f"{out} holds {finished} records measured in another environment (env.json differs in: "
                          f"{', '.join(changed)}); resuming would mix two measurements: choose another output_dir, "
                          "or resume where they were measured")


def _check_config(out: Path, cfg: DictConfig, finished: int, note: Callable[[str], None]) -> None:
    saved = out / "config.yaml"
    if not saved.exists():
        return
    try:
        previous = comparable(OmegaConf.load(saved))
    except Exception as err:  # noqa: BLE001 - any unreadable YAML
        if finished:
            raise OutputError(f"{saved} is unreadable ({type(err).__name__}) but {out} holds {finished} finished "
                              "records: choose another output_dir") from None
        return
    current = comparable(cfg)
    if previous == current:
        return
    changed = _differences(previous, current)
    if finished:
        raise ConfigError(
            f"{out} already holds a run with a different configuration (differs in: {changed}). "
            "Finished records are never overwritten: choose another output_dir=..., or rerun the "
            "original command to resume it."
        )
    note(f"{out} holds no finished record yet: taking the new configuration (changed: {', '.join(changed)})")


def _check_provenance(out: Path, provenance: dict[str, Any], finished: int) -> None:
    path = out / PROVENANCE_NAME
    if not finished or not path.exists():
        return
    try:
        previous = json.loads(path.read_text())
        before = previous["datasets"]
    except (OSError, ValueError, KeyError, TypeError):
        raise OutputError(f"{path} is unreadable, so resuming cannot check the prompts: choose another output_dir") \
            from None
    for name, now in provenance.get("datasets", {}).items():
        was = before.get(name)
        if was is None:
            continue
        for field in ("file_sha256", "prompt_set_sha256"):
            if was.get(field) != now.get(field):
                raise ConfigError(
                    f"{out} was measured on other {name} prompts ({field} {str(was.get(field))[:12]} from "
                    f"{was.get('source')}; now {str(now.get(field))[:12]} from {now.get('source')}). Resuming "
                    "would mix two prompt sets: use the original assets_dir, or another output_dir."
                )


def _check_prompts(out: Path, prompts: dict[str, list[str]], base: dict[str, str]) -> None:
    """Finished records must have been measured on the prompts this run would give them (their
    `prompt_sha256`): checked before anything is written, so a refused start changes nothing."""
    from specter.records.records import record_key

    try:
        text = (out / "records.csv").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return
    for _, _, values in parse_records(text)[1]:
        key = record_key(values)
        digest = values.get("prompt_sha256", "")
        if not digest or (base and tuple(key[:3]) != (base.get("method"), base.get("model"), base.get("memory"))):
            continue
        refuse_other_prompt(out, key[3], int(key[4]), digest, prompts)


def refuse_other_prompt(out: Path, ds: str, i: int, digest: str, prompts: dict[str, list[str]]) -> None:
    """A finished record of `ds` prompt `i` (prompt_sha256 `digest`) must have been measured on the
    prompt this run would give it: else resuming would mix two prompt sets."""
    texts = prompts.get(ds)
    if texts is not None and i < len(texts) and text_digest(texts[i]) != digest:
        raise ConfigError(f"{out}: the finished record for {ds} prompt {i} was measured on another prompt "
                          f"(prompt_sha256 {digest[:12]}, now {text_digest(texts[i])[:12]}); resuming would "
                          "mix two prompt sets: use the original assets_dir, or another output_dir")


@contextmanager
def run_folder(cfg: DictConfig, provenance: dict[str, Any] | None = None,
               note: Callable[[str], None] | None = None,
               prompts: dict[str, list[str]] | None = None) -> Iterator[Path]:
    """Create or reopen `output_dir`, locked for the duration of the `with` block.

    Order: take the lock (a second run is refused naming the holder's pid), then check that the
    folder is a Specter run folder, and that one with finished records holds this same run
    (configuration, prompt files, and, given `prompts`, each finished record's prompt). Only when
    every check passed are `config.yaml` and `provenance.json` written, atomically: a refused
    start leaves the folder exactly as it was.
    """
    note = note or (lambda msg: print(f"specter: {msg}", file=sys.stderr, flush=True))
    out = Path(cfg.output_dir)
    created = not out.exists()
    before = set(p.name for p in out.iterdir()) if out.is_dir() else set()
    try:
        if out.exists() and not out.is_dir():
            raise OutputError(f"cannot use output_dir={out}: it is a file, not a folder")
        out.mkdir(parents=True, exist_ok=True)
        had_lock = (out / LOCK_NAME).exists()
    except OSError as err:
        raise _os_error(out, err) from None
    fd = _lock(out)
    try:
        try:
            foreign = not (out / "config.yaml").exists() and any(p.name != LOCK_NAME for p in out.iterdir())
        except OSError as err:
            raise _os_error(out, err) from None
        if foreign:
            if not had_lock:
                (out / LOCK_NAME).unlink(missing_ok=True)
            raise OutputError(f"{out} exists, is not empty and holds no Specter run: choose another output_dir")
        finished = finished_records(out)
        _check_written(out, finished)
        _check_config(out, cfg, finished, note)
        check_environment(out, finished)
        provenance = dict(provenance or {})
        _check_provenance(out, provenance, finished)
        if finished and prompts is not None:
            base = {k: str(OmegaConf.select(cfg, f"{k}.name")) for k in ("method", "model", "memory")}
            _check_prompts(out, prompts, base)
        try:
            text = OmegaConf.to_yaml(cfg, resolve=True)
            atomic_write_text(out / "config.yaml", text)
            provenance["config_sha256"] = hashlib.sha256(text.encode()).hexdigest()  # what resuming checks
            previous = read_provenance(out)
            provenance["code"] = merged_states(previous.get("code"), code_state())  # commit and code trees
            atomic_write_text(out / PROVENANCE_NAME, json.dumps({**previous, **provenance}, indent=1, sort_keys=True))
        except OSError as err:
            raise _os_error(out, err) from None
        yield out
    except BaseException:
        if finished_records(out) == 0:  # a refused or aborted start: leave nothing that looks like a run
            remove_refused_start(out, created, before)
        raise
    finally:
        os.close(fd)  # releases the lock


def remove_refused_start(out: Path, created: bool, before: set[str]) -> None:
    """Undo what a start that finished no record wrote: the whole folder if this start created it,
    else only the files it added (config.yaml, provenance.json, a header-only records.csv, env.json...)."""
    import shutil

    if created:
        shutil.rmtree(out, ignore_errors=True)
        return
    for path in out.iterdir():
        if path.name not in before:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def read_provenance(out: Path) -> dict[str, Any]:
    return read_json_object(Path(out) / PROVENANCE_NAME)


def check_weights(out: Path, digest: str, finished: int) -> None:
    """Refuse to resume on other weights than the finished records were measured with; record them."""
    data = read_provenance(out)
    was = data.get("weights_sha256")
    if finished and was and was != digest:
        raise ConfigError(f"{out} was measured with other weights (sha256 {was[:12]}, now {digest[:12]}): the "
                          "model was rebuilt or replaced since; use another output_dir")
    try:
        atomic_write_text(Path(out) / PROVENANCE_NAME, json.dumps({**data, "weights_sha256": digest}, indent=1,
                                                                   sort_keys=True))
    except OSError as err:
        raise _os_error(Path(out), err) from None


def _git_sha() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
            cwd=Path(__file__).resolve().parents[2],
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def environment_info(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    import torch

    versions = {}
    for pkg in PACKAGES:
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    info: dict[str, Any] = {
        "packages": versions,
        "python": platform.python_version(),
        "git_sha": _git_sha(),
        "cpu": {"processor": platform.processor() or platform.machine(), "count": os.cpu_count(),
                "torch_threads": torch.get_num_threads()},
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    info.update(extra or {})
    return info


def write_environment(out: Path, extra: dict[str, Any] | None = None) -> Path:
    """env.json of the first run; a resumed run adds env.resume-N.json beside it (atomic writes)."""
    path = out / "env.json"
    n = 1
    while path.exists():
        path = out / f"env.resume-{n}.json"
        n += 1
    text = json.dumps(environment_info(extra), indent=1, sort_keys=True, default=str)
    try:
        atomic_write_text(path, text)
        data = read_provenance(out)  # each env file's sha256: resuming refuses an edited or damaged one
        data["env_sha256"] = {**(data.get("env_sha256") or {}), path.name: hashlib.sha256(text.encode()).hexdigest()}
        atomic_write_text(out / PROVENANCE_NAME, json.dumps(data, indent=1, sort_keys=True))
    except OSError as err:
        raise _os_error(out, err) from None
    return path
