"""make_figures: every figure and table from result CSVs (PNG + PDF, and each one's numbers as CSV + Markdown).

    python make_figures.py                                  # default result set (below) -> figures/
    python make_figures.py --results results/reference --figures /tmp/figs

Default result set: results/ (less its quick/, reference/, paper/, logs/ and multirun/ folders) if
it holds any result CSV; else results/quick/ (QUICK=1 reproduce runs); else results/reference/
(the committed reference set). The paper's own numbers come from --paper (results/paper/).

Outputs (missing inputs are skipped with a printed note, never drawn as placeholders):
  fig07_k_sweep                  TPOT and acceptance vs K per model, chosen K marked   (k_sweep.csv)
  table_k_used                   the K each speculative run used beside its tier's sweep (records.csv)
  fig09_planner_timeline         planner timeline of one window, Figs. 8/9 style       (trace.csv.gz)
  fig10_draft_kernel_latency     draft-kernel latency per backend                       (draft_kernel.csv)
  fig11_draft_kernel_speedup     speedup of each backend over the unfused loop          (draft_kernel.csv)
  fig13_routing                  per-window working sets and routing distances, each distinct window once
                                 (routes.csv.gz)
  fig14_tpot                     TPOT: models x tiers x datasets (+AVG) x methods       (records.csv)
  fig14_tpot_<hardware>          the same for methods run on other hardware (on a CPU: the engines
                                 that place their own weights, beside target_only; one hardware each)
  table_traced_runs              traced runs (method.trace_windows) beside the untraced run
  table_headline_speedup         Specter's TPOT speedup over each method, with each cell's verdict (records.csv,
                                 projection.csv)
  table_verdict                  per model x tier: is Specter fastest on the CPU and in the A100 projection, and why
  fig15_batch_tpot, fig16_batch_working_set, table3_batch, table_batch_scaling          (batch.csv)
  io_vs_oracle                   H2D bytes against the oracle                           (records.csv)
  fig_staging_ablation           every cache-owning method with and without staging buffers (records.csv)
  verify_schedule                expert-wise vs token-wise verification                 (verify_schedule.csv)
  fig_load_ratio                 TPOT and Specter's speedup against the link's load ratio r (load_ratio.csv)
  paper_vs_here                  the paper's numbers beside ours, as ratios            (results/paper/*.csv)
  fig14_projected_tpot, table_projected_vs_paper, fig_projected_window
                                 projected TPOT on the paper's machine beside the paper's (projection.csv,
                                 timeline.csv of experiment=project; also read from results/project/)
  fig15_projected_batch, table3_projected_batch, table3_projected_vs_paper
                                 projected batching beside the paper's Table 3 numbers (batch_projection.csv)
  fig_projected_alpha, table_projected_alpha
                                 projected TPOT against the draft's acceptance (alpha_curve.csv)
  claims                         the numbers README and ARTIFACT quote, and README's CPU speedup table
                                 (records.csv, projection.csv; tests/test_claims.py checks the prose)
  index.md                       what was written and what was skipped, and why
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import os
import time
import traceback
from pathlib import Path

from specter.figures import (
    batching,
    claims,
    draft_kernel,
    headline,
    io_oracle,
    k_sweep,
    load_ratio,
    paper_compare,
    projected_alpha,
    projected_batching,
    projection,
    routing,
    staging,
    timeline,
    tpot_grid,
    verify_schedule,
)
from specter.entry import OneLineParser, UsageError, bounded, guarded
from specter.figures.common import Output, Skip
from specter.figures.data import ResultSet, default_results

FIGURES = (
    ("Fig. 7 K sweep", k_sweep),
    ("Figs. 8/9 planner timeline", timeline),
    ("Figs. 10/11 draft kernel", draft_kernel),
    ("Fig. 13 routing diversity", routing),
    ("Fig. 14 TPOT grid", tpot_grid),
    ("Headline speedups", headline),
    ("Figs. 15/16 + Table 3 batching", batching),
    ("I/O vs oracle", io_oracle),
    ("Staging-buffer ablation", staging),
    ("Verification schedule", verify_schedule),
    ("TPOT against the load ratio", load_ratio),
    ("Paper vs here", paper_compare),
    ("Projected Fig. 14 (virtual clock)", projection),
    ("Projected batching (virtual clock)", projected_batching),
    ("Projected alpha curve (virtual clock)", projected_alpha),
    ("The numbers the prose quotes", claims),
)


NAMES = tuple(m.__name__.rsplit(".", 1)[1] for _, m in FIGURES)
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})  # nothing more can be written


def main(argv: list[str] | None = None, repo: Path | None = None) -> int:
    """0: every figure built or skipped with a note; 1: a figure failed; 2: bad arguments or an
    unusable output folder (one line, nothing drawn)."""
    return guarded("make_figures.py", lambda: _main(argv, repo or Path.cwd()))


def _main(argv: list[str] | None, repo: Path) -> int:
    doc = __doc__.split("\n\n")
    ap = OneLineParser(prog="make_figures.py", description=doc[0], epilog="\n\n".join(doc[1:]),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=None,
                    help="result set, searched recursively (default: see below)")
    ap.add_argument("--figures", type=Path, default=repo / "figures", help="output folder (default: figures/)")
    ap.add_argument("--paper", type=Path, default=repo / "results" / "paper",
                    help="the paper's typed numbers (default: results/paper/)")
    ap.add_argument("--only", nargs="+", default=None, metavar="NAME", help="build only these (module names: "
                    + ", ".join(NAMES) + ")")
    ap.add_argument("--dpi", type=bounded(int, 10, 1200, "a resolution in [10, 1200] dots per inch"), default=150)
    args = ap.parse_args(argv)
    unknown = sorted(set(args.only or ()) - set(NAMES))
    if unknown:
        raise UsageError(f"--only {' '.join(unknown)}: no such figure; choose from {', '.join(NAMES)}")
    results_dir = args.results or default_results(repo)
    if not results_dir.is_dir():  # "0 files" would read as "nothing to draw", not as a typo
        what = "is a file" if results_dir.exists() else "does not exist"
        raise UsageError(f"--results {results_dir} {what}: give a folder of results")
    for folder in (args.figures, *args.figures.parents):
        if folder.exists() and not folder.is_dir():
            raise UsageError(f"--figures {args.figures}: {folder} is a file, not a folder")
    results = ResultSet(results_dir, args.paper)
    refuse_copies(results)
    print(f"results: {results_dir}{'' if args.results else ' (default)'}  ->  figures: {args.figures}")
    warn_stale_code(results_dir, repo)
    try:
        return _build(results, args, results_dir)
    except OSError as err:
        if err.errno not in DISK_ERRNOS and not isinstance(err, PermissionError):
            raise
        where = f" writing {err.filename}" if err.filename else ""
        raise UsageError(f"{err.strerror or err}{where}; free space (or make {args.figures} writable) and "
                         "rerun") from None


def refuse_copies(results: ResultSet) -> None:
    """The same run's records in two folders (a copied run folder) would be counted twice: refused.

    Two runs never write the same records.csv: each record carries its own start and finish times
    (`started_at`, `finished_at`), so equal bytes are a copy. Files without those columns (hand-made
    or synthetic sets) are not compared."""
    seen: dict[str, Path] = {}
    for path in results.files("records.csv"):
        data = path.read_bytes()
        if b"started_at" not in data.split(b"\n", 1)[0]:
            continue
        digest = hashlib.sha256(data).hexdigest()
        if digest in seen:
            raise UsageError(f"{seen[digest].parent} and {path.parent} hold the same records.csv (a copied "
                             "run folder): its records would be counted twice; remove one of them")
        seen[digest] = path


def _build(results: ResultSet, args: argparse.Namespace, results_dir: Path) -> int:
    args.figures.mkdir(parents=True, exist_ok=True)
    out = Output(args.figures, dpi=args.dpi)
    index = [f"# Figures from `{results_dir}`", "", "| figure | status | files |", "|---|---|---|"]
    failed = 0
    for title, module in FIGURES:
        name = module.__name__.rsplit(".", 1)[1]
        if args.only and name not in args.only:
            continue
        before = len(out.written)
        start = time.perf_counter()
        try:
            module.build(results, out)
            files = sorted({p.stem for p in out.written[before:]})
            status = "written" if files else "nothing to draw"
            print(f"{title}: {', '.join(files) or 'nothing written'} ({time.perf_counter() - start:.1f}s)")
        except Skip as note:
            status, files = f"skipped: {note}", []
            print(f"{title}: skipped: {note}")
        except OSError as err:
            if err.errno in DISK_ERRNOS or isinstance(err, PermissionError):
                raise  # no later figure can be written either
            failed, status, files = failed + 1, _failed(title, err), []
        except Exception as err:  # one broken input must not hide every other figure
            failed, status, files = failed + 1, _failed(title, err), []
        index.append(f"| {title} | {status} | {', '.join(files)} |")
    (args.figures / "index.md").write_text("\n".join(index) + "\n")
    print(f"{len(out.written)} files in {args.figures}/ (index.md lists them)")
    return 1 if failed else 0


def _failed(title: str, err: Exception) -> str:
    """One line per failed figure (its traceback only with SPECTER_VERBOSE=1)."""
    status = f"FAILED: {type(err).__name__}: {' '.join(str(err).split())}"
    print(f"{title}: {status}")
    if os.environ.get("SPECTER_VERBOSE") == "1":
        traceback.print_exc()
    return status


def warn_stale_code(results_dir: Path, repo: Path) -> int:
    """One warning per run folder whose specter/ or baselines/ tree is not HEAD's, and per folder of result
    files no provenance covers; how many."""
    from specter.code_provenance import stale_folders, unrecorded_files

    if not results_dir.is_dir():
        return 0
    stale = stale_folders(results_dir, repo)
    for folder, why in stale:
        print(f"warning: {folder}: {why}; its numbers may not be what this checkout measures")
    if stale:
        print(f"warning: {len(stale)} result folder(s) under {results_dir} were not measured by HEAD's code "
              "(specter/, baselines/)")
    bare = unrecorded_files(results_dir)
    folders = sorted({p.parent for p in bare})
    for folder in folders:
        names = ", ".join(p.name for p in bare if p.parent == folder)
        print(f"warning: {folder}: {names} carry no provenance (no commit or code digest): which code measured "
              "them cannot be checked")
    return len(stale) + len(folders)
