"""Headline table: Specter's TPOT speedup over every other method, per model and memory tier.

speedup = TPOT(method) / TPOT(specter) on mean TPOT (> 1: Specter is faster).
  speedup_avg   on the AVG column of Fig. 14 (mean over datasets)
  mean_speedup  mean over datasets of the per-dataset speedups
  max_speedup   the largest per-dataset speedup
Only methods measured on the same hardware as Specter are compared (an engine run on the bare
CPU is not set against Specter on the emulated link; it has its own figure, fig14_tpot_cpu).
Rows with model = ALL summarise each method over every (model, tier): the mean of speedup_avg and
the max of max_speedup (the paper's "average 1.50×, up to 1.88×" over SpecMoEOff).
"""

from __future__ import annotations

import pandas as pd

from specter.figures.common import Output, Skip, order_methods
from specter.figures.data import ResultSet
from specter.figures.tpot_grid import tpot_table

NAME = "table_headline_speedup"
TITLE = "Headline: Specter's TPOT speedup over each method (mean TPOT ratio, > 1 = Specter faster)"
REFERENCE = "specter"


def speedup_table(tpot: pd.DataFrame, reference: str = REFERENCE) -> pd.DataFrame:
    rows = []
    if "hardware" not in tpot.columns:
        tpot = tpot.assign(hardware="unknown")
    for (model, memory, hardware), g in tpot.groupby(["model", "memory", "hardware"], sort=False):
        ref = g[g["method"] == reference].set_index("dataset")["mean_ms"]
        if ref.empty:
            continue
        for method in order_methods(g["method"]):
            if method == reference:
                continue
            other = g[g["method"] == method].set_index("dataset")["mean_ms"]
            per_ds = (other / ref).drop("AVG", errors="ignore").dropna()
            if "AVG" not in other.index or per_ds.empty:
                continue
            rows.append({"model": model, "memory": memory, "hardware": hardware, "method": method,
                         "specter_ms": ref["AVG"], "method_ms": other["AVG"],
                         "speedup_avg": other["AVG"] / ref["AVG"],
                         "mean_speedup": per_ds.mean(), "max_speedup": per_ds.max(),
                         "max_at": per_ds.idxmax(), "datasets": len(per_ds)})
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    summary = [{"model": "ALL", "memory": "ALL", "hardware": ",".join(sorted(set(g["hardware"]))), "method": method,
                "speedup_avg": g["speedup_avg"].mean(), "mean_speedup": g["mean_speedup"].mean(),
                "max_speedup": g["max_speedup"].max(),
                "max_at": "{}/{}/{}".format(*g.loc[g["max_speedup"].idxmax(), ["model", "memory", "max_at"]]),
                "datasets": int(g["datasets"].sum())}
               for method, g in table.groupby("method", sort=False)]
    return pd.concat([table, pd.DataFrame(summary)], ignore_index=True)


def build(results: ResultSet, out: Output) -> None:
    records = results.records("main")
    if records.empty:
        raise Skip("no records.csv")
    tpot = tpot_table(records.dropna(subset=["tpot_ms"]))
    if REFERENCE not in set(tpot["method"]):
        raise Skip(f"no '{REFERENCE}' records (method=specter with one configuration) to compare against")
    table = speedup_table(tpot)
    if table.empty:
        raise Skip("no other method shares a model, memory tier and hardware with specter")
    out.table(table, NAME, TITLE, notes=[
        "speedup_avg: on the AVG over datasets; mean/max_speedup: over per-dataset speedups. "
        "ALL rows: mean of speedup_avg and max of max_speedup over every model and tier. Only methods "
        "measured on Specter's hardware are compared."])
