"""`python -m specter.projection.grid [--device D] [overrides...]`: experiment=project for every real model and
tier (dsv2, qwen15moe, phi35moe x high, low), each into <results>/project/<model>-<memory>-<device>/ (results/
by default), which make_figures' projected Fig. 14 reads. Extra arguments are passed on as overrides (e.g. project.new_tokens=32).
"""

from __future__ import annotations

import argparse
import sys

MODELS = ("dsv2", "qwen15moe", "phi35moe")
TIERS = ("high", "low")


def main(argv: list[str] | None = None) -> int:
    from specter.harness.compose import compose
    from specter.harness.experiments import run_experiment

    ap = argparse.ArgumentParser(prog="python -m specter.projection.grid", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="a100_40gb_pcie4", help="device file (default: %(default)s)")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--tiers", nargs="+", default=list(TIERS), choices=TIERS)
    ap.add_argument("--results", default="results", help="result set the project/ folders go into (default: %(default)s)")
    args, overrides = ap.parse_known_args(argv)
    for model in args.models:
        for tier in args.tiers:
            run_experiment(compose(["experiment=project", f"model={model}", f"memory={tier}",
                                    f"project.device={args.device}",
                                    f"output_dir={args.results}/project/{model}-{tier}-{args.device}", *overrides]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
