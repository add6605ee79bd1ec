"""Train the tiny MoE checkpoints for a fixed number of steps (deterministic, one thread).

    python -m initialization.train_tiny                      # all three, about 3-4 CPU minutes each
    python -m initialization.train_tiny tiny_qwen --steps 50 # a shorter variant (not the pinned one)

Benchmarks and the default run use the trained variants; `python run.py` also builds a missing
one on first use. See `specter.models.tiny_train` for what is recorded and the quality gates.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specter.models import tiny, tiny_train
from specter.routing_stats import held_out_routing


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", default=sorted(tiny.TINY_SPECS), help="tiny models (default: all)")
    ap.add_argument("--steps", type=int, default=None,
                    help="training steps (default: the pinned count per model: "
                         + ", ".join(f"{k} {v}" for k, v in sorted(tiny_train.DEFAULT_STEPS.items())) + ")")
    ap.add_argument("--balance", type=float, default=None,
                    help="weight of the per-layer expert balance loss (default: per model, "
                         + ", ".join(f"{k} {v}" for k, v in sorted(tiny_train.BALANCE_COEF.items())) + ")")
    ap.add_argument("--root", type=Path, default=None, help="models folder (default: $SPECTER_HOME/models)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    unknown = [n for n in args.names if n not in tiny.TINY_SPECS]
    if unknown:
        ap.error(f"unknown tiny model(s) {unknown}; choose from {sorted(tiny.TINY_SPECS)}")
    if args.steps is not None and args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    if args.balance is not None and not args.balance >= 0:
        ap.error(f"--balance must be a number >= 0, got {args.balance}")
    status = 0
    for name in args.names:
        try:
            with tiny.build_lock(tiny.tiny_dir(name, trained=True, root=args.root)):
                out = tiny_train.train(name, steps=args.steps, root=args.root, progress=not args.no_progress,
                                       balance=args.balance, routing=held_out_routing)
            print(f"{name}: {out}")
        except tiny_train.TrainingRejected as exc:
            print(f"error: {exc}", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    raise SystemExit(main())
