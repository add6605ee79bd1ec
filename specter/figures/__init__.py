"""Figures and tables of the Specter paper, regenerated from result CSVs only (no model, no torch).

One module per figure; each has `build(results, out)` and raises `Skip` when its input is absent.
`python make_figures.py` runs them all (see specter/figures/cli.py).
"""
