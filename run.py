"""Specter: run one configuration and write its records.

    python run.py                                     # the default comparison (experiment=compare)
    python run.py model=dsv2 memory=low               # Specter on DeepSeek-V2-Lite (GPU when visible)
    python run.py model=tiny_dsv2 method=specter memory=low dataset=gsm8k num_prompts=2
    python run.py experiment=main model=tiny_phi method=offload_ar hardware=emulated
    python run.py experiment=cell model=tiny_phi memory=low cell.methods=[offload_ar,specter]  # interleaved
    python run.py --help                              # every group and option
    python run.py -m model=tiny_qwen,tiny_dsv2 ...    # a Hydra multirun (sweeps, launchers)

Config groups live in conf/ (model, memory, dataset, method, hardware, experiment). Plain
`key=value` runs go through `specter.experiments.cli.main` (one-line errors, exit status 2); Hydra's
own flags (`--help`, `--cfg`, `-m`, `hydra.*` overrides) go through Hydra's entry point.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from specter.assembly.schema import register_schemas

register_schemas()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def hydra_main(cfg: DictConfig) -> None:
    from specter.assembly.config import check_composed
    from specter.assembly.errors import USER_ERRORS, disk_error, report
    from specter.experiments.dispatch import run_experiment

    try:
        check_composed(cfg)
        run_experiment(cfg)
    except USER_ERRORS as err:
        report(err)
        sys.exit(2)
    except OSError as err:
        if disk_error(err) is None:
            raise
        report(disk_error(err))
        sys.exit(2)


def _needs_hydra(argv: list[str]) -> bool:
    """Hydra flags and hydra.* overrides need Hydra's launcher; plain overrides do not."""
    return any(a.startswith("-") or a.lstrip("+~").startswith(("hydra.", "hydra/")) for a in argv)


# Hydra's own output locations: each job's folder is its output_dir (conf/config.yaml), and Hydra
# writes nothing of its own beside it; moving them would scatter a run's files outside its folder.
FIXED_HYDRA_KEYS = ("hydra.output_subdir", "hydra.run.dir", "hydra.sweep.subdir", "hydra.job.chdir",
                    "hydra.runtime.output_dir")


def _hydra_location_override(argv: list[str]) -> str | None:
    """The first override that moves one of Hydra's output locations, if any."""
    for arg in argv:
        key = arg.lstrip("+~").partition("=")[0]
        if key in FIXED_HYDRA_KEYS:
            return arg
    return None


def with_default_job(argv: list[str]) -> list[str]:
    """Hydra flags with no override (`--cfg job`, `-m`) act on the default job, as plain `python run.py`
    does; `--help`/`--hydra-help` describe conf/config.yaml itself."""
    from specter.assembly.compose import DEFAULT_JOB

    overrides = [a for a in argv if "=" in a or a.startswith(("~", "+"))]  # not flag values (`--cfg job`)
    if overrides or any(a in ("-h", "--help", "--hydra-help", "--info", "-i") for a in argv):
        return argv
    return [*argv, *DEFAULT_JOB]


def _hydra_entry(argv: list[str]) -> int:
    """A Hydra run (one job or a multirun) under the refusal rule; Ctrl-C or SIGTERM at any stage is one
    line and status 130 / 143 (specter/experiments/cli.py interrupted)."""
    from specter.entry import interrupt, terminate_as_interrupt

    try:
        with terminate_as_interrupt():
            from specter.assembly.compose import check_optional_groups
            from specter.assembly.config import ConfigError
            from specter.assembly.errors import report

            try:  # Hydra's multirun skips a missing option of an optional group: refuse it first
                check_optional_groups([a for a in argv if not a.startswith("-")])
                moved = _hydra_location_override(argv)
                if moved:
                    raise ConfigError(f"{moved}: Hydra's output locations are fixed (each job's files stay in "
                                      "its output_dir); choose the folder with output_dir=... (and "
                                      "hydra.sweep.dir=... for a multirun's multirun.yaml)")
            except ConfigError as err:
                report(err)
                return 2
            hydra_main()
            interrupt.raise_held()
            return 0
    except KeyboardInterrupt as err:
        from specter.experiments.cli import interrupted

        return interrupted(err)


if __name__ == "__main__":
    import signal

    # a run a script starts in the background inherits SIGINT ignored: take it back, as specter's commands
    # do (specter/cli.py interruptible), so Ctrl-C or kill -INT stops it with status 130 at every stage;
    # the handler raises at a safe point, never inside an import (specter/entry.py SafePoint)
    from specter.entry import interrupt

    signal.signal(signal.SIGINT, interrupt)
    if _needs_hydra(sys.argv[1:]):
        sys.argv[1:] = with_default_job(sys.argv[1:])
        sys.exit(_hydra_entry(sys.argv[1:]))
    else:
        from specter.experiments.cli import main

        sys.exit(main(sys.argv[1:]))
