"""Regenerate figures and tables from result CSVs only (no model is loaded).

    python make_figures.py                      # reads results/, writes figures/
    python make_figures.py --results results --figures figures

Produces, from whatever results exist:
  tpot_by_method.png / .csv   Fig. 14 style: median TPOT per model × memory tier × method
  k_sweep.png                 Fig. 7 style: mean TPOT vs K per model (from k_sweep.csv files)
  verify_schedule.png         expert-wise vs token-wise verification speedup per K
  io_vs_oracle.png            H2D bytes per token against the Belady oracle, per method
Missing inputs are skipped with a note, never drawn as placeholders.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

PALETTE = ["#3b6ea8", "#e1812c", "#3a923a", "#c03d3e", "#9372b2", "#845b53", "#d684bd", "#7f7f7f"]


def load_records(results: Path) -> pd.DataFrame:
    frames = []
    for path in sorted(results.rglob("records.csv")):
        if path.parent.name.startswith("K="):  # K-sweep points belong to k_sweep.png only
            continue
        df = pd.read_csv(path)
        if df.empty:
            continue
        variant = df.method.astype(str)
        cfg = path.parent / "config.yaml"
        if cfg.exists() and "prefetch:" in cfg.read_text() and (df.method == "specter").any():
            prefetch = next(line.split(":", 1)[1].split("#")[0].strip() for line in cfg.read_text().splitlines()
                            if line.strip().startswith("prefetch:"))
            variant = variant.where(df.method != "specter", f"specter[{prefetch}]")
        frames.append(df.assign(variant=variant, run=str(path.parent)))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _style(ax, title: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=11, loc="left", fontweight="bold")
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    ax.spines[["top", "right"]].set_visible(False)


def tpot_by_method(records: pd.DataFrame, figures: Path) -> None:
    table = records.groupby(["model", "memory", "variant"]).tpot_ms.median()
    table.unstack("variant").to_csv(figures / "tpot_by_method.csv")
    variants = sorted(records.variant.unique(), key=lambda v: (v != "target_only", v != "offload_ar", v))
    colors = dict(zip(variants, PALETTE))
    models = list(dict.fromkeys(records.model))
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.6), squeeze=False)
    width = 0.8 / len(variants)
    for ax, model in zip(axes[0], models):
        tiers = [t for t in ("high", "low") if (model, t) in table.index.droplevel("variant")]
        for i, variant in enumerate(variants):
            xs, ys = [], []
            for j, tier in enumerate(tiers):
                if (model, tier, variant) in table.index:
                    xs.append(j + (i - (len(variants) - 1) / 2) * width)
                    ys.append(table[(model, tier, variant)])
            ax.bar(xs, ys, width=width, color=colors[variant], label=variant)
        ax.set_xticks(range(len(tiers)), tiers)
        ax.set_xlim(-0.5, len(tiers) - 0.5)
        _style(ax, model, "TPOT (ms/token, median)")
        ax.set_xlabel("memory tier")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[v]) for v in variants]
    fig.legend(handles, variants, loc="upper center", ncol=min(6, len(variants)), frameon=False,
               bbox_to_anchor=(0.5, 1.08))
    fig.tight_layout()
    fig.savefig(figures / "tpot_by_method.png", dpi=150, bbox_inches="tight")
    plt.close(fig)


def io_vs_oracle(records: pd.DataFrame, figures: Path) -> None:
    sub = records.dropna(subset=["oracle_h2d_bytes"])
    if sub.empty:
        print("io_vs_oracle: no record has oracle_h2d_bytes; skipped")
        return
    g = sub.groupby(["model", "memory", "variant"])
    ratio = (g.h2d_bytes.sum() / g.oracle_h2d_bytes.sum()).unstack("variant")
    ax = ratio.plot.bar(figsize=(8, 3.6), color=PALETTE, rot=30, width=0.8)
    ax.axhline(1.0, color="black", lw=1, ls="--")
    ax.text(ax.get_xlim()[1], 1.0, " oracle", va="center", fontsize=8)
    _style(ax, "H2D bytes relative to the perfect-knowledge oracle", "bytes / oracle bytes")
    ax.set_xlabel("")
    ax.figure.tight_layout()
    ax.figure.savefig(figures / "io_vs_oracle.png", dpi=150)
    plt.close(ax.figure)


def k_sweep(results: Path, figures: Path) -> None:
    paths = sorted(results.rglob("k_sweep.csv"))
    if not paths:
        print("k_sweep: no k_sweep.csv under results/; skipped")
        return
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for color, path in zip(PALETTE, paths):
        df = pd.read_csv(path)
        ax.plot(df.K, df.mean_tpot_ms, marker="o", color=color, label=path.parent.name)
        best = df.loc[df.mean_tpot_ms.idxmin()]
        ax.scatter([best.K], [best.mean_tpot_ms], s=120, facecolors="none", edgecolors=color)
    _style(ax, "K sweep (circled: chosen K)", "mean TPOT (ms/token)")
    ax.set_xlabel("speculation depth K")
    ax.legend(frameon=False, fontsize=8)
    fig.tight_layout()
    fig.savefig(figures / "k_sweep.png", dpi=150)
    plt.close(fig)


def verify_schedule(results: Path, figures: Path) -> None:
    paths = sorted(results.rglob("verify_schedule.csv"))
    if not paths:
        print("verify_schedule: no verify_schedule.csv; skipped")
        return
    df = pd.concat(pd.read_csv(p) for p in paths)
    table = df.pivot_table(index=["model", "memory"], columns="K", values="speedup")
    ax = table.plot.bar(figsize=(7, 3.6), color=PALETTE, rot=30, width=0.8)
    ax.axhline(1.0, color="black", lw=1, ls="--")
    _style(ax, "Verification: expert-wise speedup over token-wise", "speedup (x)")
    ax.set_xlabel("")
    ax.legend(title="K", frameon=False)
    ax.figure.tight_layout()
    ax.figure.savefig(figures / "verify_schedule.png", dpi=150)
    plt.close(ax.figure)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="results", help="folder searched recursively for CSVs")
    ap.add_argument("--figures", default="figures", help="output folder")
    args = ap.parse_args(argv)
    results, figures = Path(args.results), Path(args.figures)
    figures.mkdir(parents=True, exist_ok=True)
    records = load_records(results)
    if records.empty:
        print(f"no records.csv under {results}/; nothing to plot for TPOT or I/O")
    else:
        tpot_by_method(records, figures)
        io_vs_oracle(records, figures)
    k_sweep(results, figures)
    verify_schedule(results, figures)
    print(f"figures in {figures}/: {sorted(p.name for p in figures.glob('*.png'))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
