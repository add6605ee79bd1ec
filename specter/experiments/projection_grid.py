"""`python -m specter.experiments.projection_grid [--device D] [--batch] [--alpha] [overrides...]`: experiment=project for every
real model and tier (dsv2, qwen15moe, phi35moe x high, low), each into <results>/project/<model>-<memory>-<device>/
(results/ by default), which make_figures' projected figures read. Extra arguments are passed on as overrides
(e.g. project.new_tokens=32).

--batch adds the batching step (project.batch=true) to the cells of the paper's batched evaluation: the models of
its Table 3 (DeepSeek-V2-Lite, Qwen1.5-MoE) at the high tier. --alpha adds the α curve (project.alpha=true) to
every model's high tier. Both are flags because each costs minutes per cell on a CPU.
"""

from __future__ import annotations

import argparse
import sys

MODELS = ("dsv2", "qwen15moe", "phi35moe")
TIERS = ("high", "low")
BATCH_MODELS = ("dsv2", "qwen15moe")  # the paper's Table 3 and Figs. 15/16
CURVE_TIER = "high"


def cell_overrides(model: str, tier: str, batch: bool, alpha: bool) -> list[str]:
    """The step flags a cell runs with."""
    return ([f"project.batch={str(batch and model in BATCH_MODELS and tier == CURVE_TIER).lower()}",
             f"project.alpha={str(alpha and tier == CURVE_TIER).lower()}"])


def main(argv: list[str] | None = None) -> int:
    from specter.assembly.compose import compose
    from specter.experiments.dispatch import run_experiment

    ap = argparse.ArgumentParser(prog="python -m specter.experiments.projection_grid", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="a100_40gb_pcie4", help="device file (default: %(default)s)")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--tiers", nargs="+", default=list(TIERS), choices=TIERS)
    ap.add_argument("--results", default="results", help="result set the project/ folders go into (default: %(default)s)")
    ap.add_argument("--batch", action="store_true", help="batching at B = 1..32 for dsv2 and qwen15moe, high tier")
    ap.add_argument("--alpha", action="store_true", help="the alpha curve for every model's high tier")
    args, overrides = ap.parse_known_args(argv)
    for model in args.models:
        for tier in args.tiers:
            run_experiment(compose(["experiment=project", f"model={model}", f"memory={tier}",
                                    f"project.device={args.device}", *cell_overrides(model, tier, args.batch, args.alpha),
                                    f"output_dir={args.results}/project/{model}-{tier}-{args.device}", *overrides]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
