"""Specter: run one configuration and write its records.

    python run.py                                     # tiny Qwen2-MoE, HumanEval, target-only
    python run.py model=tiny_dsv2 method=specter memory=low dataset=gsm8k num_prompts=2
    python run.py experiment=main model=tiny_phi method=offload_ar hardware=emulated
    python run.py --help                              # every group and option

Config groups live in conf/ (model, memory, dataset, method, hardware, experiment).
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from specter.harness.errors import USER_ERRORS, report
from specter.harness.schema import register_schemas

register_schemas()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from specter.harness.experiments import run_experiment

    try:
        run_experiment(cfg)
    except USER_ERRORS as err:
        report(err)
        sys.exit(2)


if __name__ == "__main__":
    main()
