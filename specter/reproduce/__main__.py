"""python -m specter.reproduce: what scripts/reproduce_all.sh runs (settings: see that script).

Exit status: 0 every step reproduced or done earlier; 1 a step failed (or was skipped because one
did); 2 a bad setting, or no requested dataset is present; 128 + N when stopped by signal N.
"""

from __future__ import annotations

import sys
import time

from specter.reproduce.datasets import DatasetDecision, decide, label
from specter.reproduce.estimate import (
    COSTS,
    MEASURED_ON,
    REFERENCE_TIMINGS,
    estimate,
    keep_timings,
    minutes,
    read_timings,
    read_timings_file,
)
from specter.reproduce.execute import (
    FAILED,
    INTERRUPTED,
    REPRODUCED,
    SKIPPED,
    Interrupted,
    Outcome,
    Runner,
    simulate,
)
from specter.reproduce.plan import Plan, build_plan, primary
from specter.reproduce.protocol import protocol
from specter.reproduce.report import summary, write_summary
from specter.reproduce.settings import REPO, Settings, SettingsError, read_settings


def say(line: str = "") -> None:
    print(line, flush=True)


def header(s: Settings, plan: Plan, data: DatasetDecision) -> list[str]:
    lines = [f"reproduce_all ({s.mode}): {len(plan.steps)} steps; models: {' '.join(s.models)}; "
             f"tiers: {' '.join(s.tiers)}; hardware: {s.hardware}; methods: {' '.join(s.methods)}"
             + (f"; launcher: {s.launcher}" if s.launcher else "") + (f"; {s.jobs} steps at a time" if s.jobs > 1 else ""),
             f"{data.summary()}  [assets: {data.assets_dir}; DATASET={s.dataset}]"]
    if s.dry_run or s.check:
        lines.append("  (decided from what is present now; a real run first lets prepare_datasets place what it can)")
    if data.narrowed:
        lines.append("  every run is given these datasets explicitly (dataset=...), as its config.yaml and "
                     "provenance.json record; to add the others:")
        lines += data.how_to_add()
    if s.one_dataset_steps and data.ready:
        batch = f"batching {primary(data.batch_ready)}; " if data.batch_ready else ""
        lines.append(f"  {s.mode.upper()}: one dataset for {batch}the trace and the prefetch ablation {primary(data.ready)}")
    lines += [f"  note: {n}" for n in plan.notes]
    return lines


def no_data_message(data: DatasetDecision) -> list[str]:
    lines = [f"reproduce_all: error: none of the requested datasets ({label(data.requested)}) is present, so no "
             "step that measures prompts can run."]
    lines += data.how_to_add()
    return lines


def check_report(s: Settings, plan: Plan) -> list[str]:
    """CHECK=1: what will run (or is done), on what data, and roughly how long on this machine."""
    timings = read_timings(s.logs)
    reference = read_timings_file(REPO / "results" / "reference" / REFERENCE_TIMINGS)
    runner = Runner(s.logs, force=s.force, say=lambda _: None)
    by_kind: dict[str, list[float]] = {}
    done = 0
    sources: dict[str, int] = {}
    for step in plan.steps:
        if runner.done_earlier(step):
            done += 1
            continue
        est = estimate(step, timings, reference)
        sources[est.source] = sources.get(est.source, 0) + 1
        by_kind.setdefault(step.kind, []).append(est.seconds)
    lines = ["", f"{'kind':<10} {'steps':>5} {'estimate':>9}"]
    total = 0.0
    for kind, secs in by_kind.items():
        total += sum(secs)
        lines.append(f"{kind:<10} {len(secs):>5} {minutes(sum(secs)):>9}")
    train = sum(by_kind.get("train", []))
    lines.append(f"{'total':<10} {sum(map(len, by_kind.values())):>5} {minutes(total):>9}"
                 + (f"   ({minutes(total - train)} without the one-time training)" if train else "")
                 + f"   ({done} step(s) already done with valid outputs, not counted)")
    model = sources.get("model", 0)
    lines.append("estimate: " + "; ".join(
        ([f"{sources['measured here']} step(s) from their own time in {s.logs}/timings.json"]
         if "measured here" in sources else [])
        + ([f"{sources['reference run']} step(s) from the reference run's times "
            f"(results/reference/{REFERENCE_TIMINGS})"] if "reference run" in sources else [])
        + ([f"{model} step(s) from per-kind constants (startup + records x per-record; from the "
            f"{MEASURED_ON}; specter/reproduce/estimate.py)"] if model else [])))
    if any(k == "train" for k in by_kind):
        lines.append(f"  training: {COSTS['train'].startup_s / 60:.0f} min per tiny model, once")
    return lines


def main(env: dict[str, str] | None = None) -> int:
    try:
        return _main(env)
    except Interrupted as sig:  # outside a step (nothing running): stop here
        print(f"reproduce_all: stopped by {sig}", file=sys.stderr)
        return 128 + sig.signum
    except OSError as err:  # the logs or results folder cannot be written
        print(f"reproduce_all: error: {err}", file=sys.stderr)
        return 2


def _main(env: dict[str, str] | None) -> int:
    try:
        s = read_settings(env)
        prompts = max(protocol(k, s.quick, sizes=s.sizes).num_prompts for k in ("main", "k_sweep", "trace", "prefetch"))
        batch_prompts = protocol("batch", s.quick, sizes=s.sizes).num_prompts
    except (SettingsError, ValueError) as err:
        print(f"reproduce_all: error: {err}", file=sys.stderr)
        return 2
    runner = Runner(s.logs, force=s.force, say=say)
    live = not (s.dry_run or s.check)
    t_all = time.monotonic()
    first = None
    if live:
        runner.install_signals()
        s.logs.mkdir(parents=True, exist_ok=True)
    try:  # reads only; a bad DATASET is reported here, before any step
        data = decide(s.dataset, s.assets_dir, prompts, batch_prompts)
    except ValueError as err:
        print(f"reproduce_all: error: DATASET={s.dataset!r}: {err}", file=sys.stderr)
        return 2
    if live:
        # the dataset check runs first (placing what prepare_datasets can: downloads when online,
        # bundled and shipped copies); what is present after it decides what every later step is given
        empty = DatasetDecision((), (), (), assets_dir=s.assets_dir)
        datasets_step = build_plan(s, empty).steps[0]
        say("reproduce_all: the dataset check first (it decides what every run is given)")
        first = runner.run_step(datasets_step, 1, 0, accept=lambda rc: rc in (0, 1))  # 1: some not ready
        if first.status == INTERRUPTED:
            return 128 + (runner.signum or 15)
        data = decide(s.dataset, s.assets_dir, prompts, batch_prompts)
    if not data.ready:
        for line in no_data_message(data):
            print(line, file=sys.stderr)
        if first is not None:
            print(f"  (what the dataset check tried: {runner.log_path(first.step)})", file=sys.stderr)
        return 2
    plan = build_plan(s, data)
    for line in header(s, plan, data):
        say(line)
    if s.check:
        for line in check_report(s, plan):
            say(line)
        return 0
    if s.dry_run:
        unknown = [n for n in s.dry_fail if n not in plan.names()]
        if unknown:
            print(f"reproduce_all: error: DRY_FAIL names no step of this plan: {', '.join(unknown)}", file=sys.stderr)
            return 2
        outcomes = simulate(plan.steps, set(s.dry_fail), say=say)
        skipped = [o for o in outcomes if o.status == SKIPPED]
        if s.dry_fail:
            say(f"DRY_FAIL: {len(skipped)} step(s) would be skipped because a step they need failed")
        return 0
    assert first is not None
    if first.status == FAILED:  # prepare_datasets itself broke, yet some datasets are present: use them
        first = Outcome(first.step, REPRODUCED, first.seconds,
                        why=f"prepare_datasets {first.why}; the runs use the datasets present")
    elif data.narrowed:
        first.why = f"narrowed to {', '.join(data.ready)}"
    runner.outcomes[plan.steps[0].name] = first
    outcomes = [first] + runner.run_all(plan.steps[1:], start=2, total=len(plan.steps), jobs=s.jobs)
    lines = summary(outcomes, data, s.mode, time.monotonic() - t_all, s.results, s.figures, s.logs)
    say()
    for line in lines:
        say(line)
    where = write_summary(lines, s.results)
    keep_timings(s.logs, s.results, plan.names())
    if where:
        say(f"(this summary: {where})")
    if runner.signum is not None:
        return 128 + runner.signum
    return 1 if any(o.status in (FAILED, SKIPPED) for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
