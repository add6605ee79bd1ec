"""`experiment=cell`: the methods of one (model, memory tier) cell, interleaved record by record.

Methods measured one after another, minutes apart, see different machines: a CPU's speed moves by
tens of percent from minute to minute, more than the gaps between methods. A cell therefore holds
every method in one process and measures the protocol's records in rounds: round n measures record
n (a dataset, prompt and repeat) once per method, in the order of `cell.methods` rotated by n
(A B C, B C A, C A B, ...), so each method takes every position equally often and the records of
one round run seconds apart. A record's `slot` is its method's position in its round; `started_at`
and `finished_at` (unix seconds) say when it ran.

Each method keeps its own run folder, exactly as `experiment=main method=<m>` writes it (the same
config.yaml, so either command resumes the other's folder), and resumes on its own: a rerun
measures only the records a method is missing, in the same rounds and slots.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from specter.assembly.config import ConfigError
from specter.records.output import run_folder
from specter.assembly.schema import CellConfig
from specter.experiments.run import MethodSession, prepare, prompt_texts, provenance_of, record_keys
from specter.records.summary import write_summary
from specter.paths import UnsafeName, safe_name

METHOD_SLOT = "{method}"  # where each method's name goes in the cell's output_dir


def rotation(methods: int, round_index: int) -> list[int]:
    """The order (indices into the cell's methods) of round `round_index`: rotated by one per round."""
    first = round_index % methods
    return [(first + j) % methods for j in range(methods)]


def cell_methods(cfg: DictConfig) -> list[str]:
    methods = list(cfg.cell.methods or ())
    if not methods:
        raise ConfigError("cell.methods is empty: list the methods of the cell, e.g. cell.methods=[offload_ar,specter]")
    twice = sorted({m for m in methods if methods.count(m) > 1})
    if twice:
        raise ConfigError(f"cell.methods lists {twice} more than once")
    for m in methods:
        try:
            safe_name(m, "cell.methods entry")
        except UnsafeName as err:
            raise ConfigError(str(err)) from None
    return methods


def method_output_dir(cfg: DictConfig, method: str) -> str:
    """The cell's output_dir with {method} filled in (no {method}: a folder per method below it)."""
    out = str(cfg.output_dir)
    return out.replace(METHOD_SLOT, method) if METHOD_SLOT in out else str(Path(out) / method)


def method_config(cfg: DictConfig, method: str) -> DictConfig:
    """The configuration `experiment=main method=<method>` composes for this cell's model and tier: its
    method group, its hardware (cell.hardware, else the cell's), the k_profile only where it applies
    (cell.k_profile_methods; cell.k_profiles gives a method a profile of its own), its own output_dir; the cell's own settings back at their defaults, so
    the folder's config.yaml is the one a standalone run writes and either resumes the other."""
    from specter.assembly.compose import compose, hardware_defaults

    option = str((cfg.cell.hardware or {}).get(method, cfg.hardware.name))
    try:
        composed = compose([f"method={method}", f"hardware={option}"])
    except Exception as err:  # noqa: BLE001 - Hydra's own message names the missing option
        raise ConfigError(f"cell: cannot compose method={method} hardware={option} "
                          f"({str(err).splitlines()[0]})") from None
    sub = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    with open_dict(sub):
        sub.method = composed.method
        for key, value in ((cfg.cell.method_overrides or {}).get(method) or {}).items():
            OmegaConf.update(sub, f"method.{key}", value, force_add=True)
        if option != cfg.hardware.name:  # keys the user set on the cell's hardware carry over
            own = hardware_defaults(cfg.hardware.name) if cfg.hardware.name != "auto" else {}
            user = {k: v for k, v in cfg.hardware.items() if k != "name" and k in own and v != own.get(k)}
            sub.hardware = OmegaConf.merge(composed.hardware, user)
        own = (cfg.cell.get("k_profiles") or {}).get(method)
        if own:  # a method that profiles its own K (SpecMoEOff over its method.k_range)
            sub.k_profile = str(own)
        elif method not in set(cfg.cell.k_profile_methods or ()):
            sub.k_profile = None
        sub.experiment = "run"
        sub.output_dir = method_output_dir(cfg, method)
        sub.cell = OmegaConf.structured(CellConfig)  # the schema's defaults
    return sub


def run_cell(cfg: DictConfig) -> list[Path]:
    """Measure every method of the cell, interleaved (see the module docstring); the run folders."""
    methods = cell_methods(cfg)
    configs = [method_config(cfg, m) for m in methods]
    preps = [prepare(sub, sub.num_prompts) for sub in configs]  # every failure before any folder is touched
    keys = record_keys(configs[0], preps[0])
    for m, sub, prep in zip(methods, configs, preps):
        if record_keys(sub, prep) != keys or prompt_texts(prep) != prompt_texts(preps[0]):
            raise ConfigError(f"cell: method {m} would measure other records than {methods[0]} "
                              "(prompts, datasets or repeats differ); a cell pairs the same records")
    folders = measure_interleaved(configs, preps, keys, f"cell {cfg.model.name}/{cfg.memory.name}")
    _print_cell(cfg, folders)
    return folders


def measure_interleaved(configs: list[DictConfig], preps: list, keys: list, name: str) -> list[Path]:
    """One run folder per config, every method built and warmed up first, then each record key measured once
    per method in rotated order (`rotation`); finished records are kept. The folders, in config order."""
    with ExitStack() as stack:
        sessions = []
        for sub, prep in zip(configs, preps):
            out = stack.enter_context(run_folder(sub, provenance_of(prep.prompt_sets), prompts=prompt_texts(prep)))
            sessions.append(MethodSession(sub, prep, out))
        for session in sessions:
            stack.callback(session.close)
        pending = [s for s in sessions if s.todo]
        if not pending:
            print(f"{name}: every record of every method is already finished; "
                  "nothing to run (records are never overwritten).")
        for session in pending:  # every method built and warmed up before the first timed record
            session.start()
        for n, key in enumerate(keys):
            for slot, index in enumerate(rotation(len(sessions), n)):
                session = sessions[index]
                if key in session.todo:
                    session.measure(*key, slot=slot)
        for session in sessions:
            write_summary(session.out)
        return [s.out for s in sessions]


def _print_cell(cfg: DictConfig, folders: list[Path]) -> None:
    """The cell's methods side by side (median TPOT, paired speedups), as experiment=compare prints them."""
    import pandas as pd

    from specter.experiments.compare import comparison_table, print_comparison
    from specter.records.records import read_records

    records = pd.concat([read_records(f / "records.csv") for f in folders], ignore_index=True)
    if records.empty:
        return
    print_comparison(comparison_table(records), title=f"cell {cfg.model.name} at memory={cfg.memory.name} "
                                                      f"(interleaved; folders {', '.join(str(f) for f in folders)})")
