"""Regenerate every figure and table from result CSVs only (no model is loaded, torch not needed).

    python make_figures.py                                  # default result set -> figures/
    python make_figures.py --results results/reference --figures /tmp/figs
    python make_figures.py --help                           # outputs and the default result set

The figure code lives in specter/figures/ (one module per figure).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO))

from specter.figures.cli import main

if __name__ == "__main__":
    raise SystemExit(main(repo=REPO))
