"""The steps of reproduce_all: each one's command, the steps it needs and the outputs that prove it ran.

Order: check the datasets -> train the tiny models (once) -> K sweep per model and tier -> the main
grid (tiny models: one experiment=cell step per model x tier, its in-process methods interleaved record
by record in one process; a real model's methods, and an out-of-process engine (vLLM), keep a step
each) -> the staging ablation (every cache-owning method with
method.staging_buffers=0; QUICK: the first model's low tier) -> batching -> planner trace ->
benchmarks (draft kernel, verification schedule, prefetch ablation) -> make_figures.py.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from specter.assembly.runners import is_method
from specter.assembly.schema import SpecterMethodConfig
from specter.reproduce.datasets import DatasetDecision, dataset_overrides
from specter.reproduce.protocol import protocol
from specter.reproduce.settings import REPO, Settings

# what make_figures draws each step's outputs into (for the closing summary)
FEEDS = {
    "k_sweep": "Fig. 7 K sweep",
    "main": "Fig. 14 TPOT grid, headline speedups, Fig. 13 routing, I/O vs oracle",
    "ablation": "staging-buffer ablation (fig_staging_ablation)",
    "batch": "Figs. 15/16 + Table 3 batching",
    "trace": "Figs. 8/9 planner timeline",
    "bench-draft-kernel": "Figs. 10/11 draft kernel",
    "bench-verify": "Verification schedule",
    "bench-prefetch": "results/bench/bench_methods.csv (prefetch ablation)",
}


@dataclass(frozen=True)
class Check:
    """One output a finished step leaves: kind in trained | run | k_sweep | batch | trace | csv."""

    kind: str
    path: Path
    datasets: tuple[str, ...] = ()   # run/trace: the datasets its records must cover


@dataclass(frozen=True)
class Step:
    name: str                                  # "<mode>.<kind>-<what>", also its log and marker name
    kind: str                                  # datasets | train | k_sweep | main | ablation | batch | trace | bench | project | figures
    argv: tuple[str, ...]
    needs: tuple[str, ...] = ()                # names of the steps whose outputs it reads
    checks: tuple[Check, ...] = ()             # its outputs; empty: rerun every time (datasets, figures)
    records: int = 0                           # records it measures (time estimate)
    units: int = 1                             # K values, batch sizes or runs it contains (time estimate)
    model: str = ""
    method: str = ""

    @property
    def command(self) -> str:
        return shlex.join(self.argv)


@dataclass
class Plan:
    steps: list[Step] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    mode: str = "quick"

    def add(self, kind: str, name: str, argv: list[str], **kw) -> Step:
        step = Step(name=f"{self.mode}.{name}", kind=kind, argv=tuple(argv), **kw)
        self.steps.append(step)
        return step

    def names(self) -> list[str]:
        return [s.name for s in self.steps]


# Method groups are the registry's facts (specter/assembly/runners.py), asked when a plan is built:
#  reads_specter_profile: runs with the tier's profiled K (Specter, and MoE-Spec: verification-time budgeting on Specter)
#  own_k_profile: profiles its own K (experiment=k_sweep method=<m>, over its method.k_range)
#  out_of_process: an engine in a process of its own (a server): it cannot share a cell's process
#  owns_cache: an expert cache, staging buffers by one rule, ablated together (method.staging_buffers=0); a preset
#  of another method's design (preset_of) is ablated as that design


def primary(ready: tuple[str, ...]) -> str:
    """The dataset of one-dataset steps (trace; QUICK batching and prefetch): HumanEval, as the
    batch experiment's default, else the first present."""
    return "humaneval" if "humaneval" in ready or not ready else ready[0]


def is_tiny(model: str) -> bool:
    return model.startswith("tiny_")


def _k_profile(s: Settings, model: str, tier: str, method: str = "specter") -> Path:
    """The K profile a run of `model` at `tier` uses: Specter's (also MoE-Spec's), or the own profile of a
    method with a profile of its own (QUICK and REFERENCE sweep the low tier only)."""
    own = "" if is_method(method, reads_specter_profile=True) else f"-{method}"
    return s.results / "k_sweep" / f"{model}-{s.profile_tier(tier)}-{s.hardware}{own}" / "k_profile.json"


def _profile_args(s: Settings, model: str, tier: str, method: str) -> list[str]:
    """`k_profile=` for a method that reads a K profile, else nothing."""
    return [f"k_profile={_k_profile(s, model, tier, method)}"] if is_method(method, reads_k_profile=True) else []


def build_plan(s: Settings, data: DatasetDecision, repo: Path = REPO) -> Plan:
    """Every step, with `data.ready` passed to each run explicitly (dataset=...)."""
    b = _Builder(s, data, repo)
    b.datasets_and_training()
    if not s.launcher:
        b.k_sweeps()
        b.main_grid()
        b.staging_ablation()
    else:
        b.sweeps.update(_multirun_grid(b.plan, s, b.ds, b.assets, b.trained, data))
    b.batching()
    b.trace()
    b.benchmarks()
    b.plan.add("figures", "figures", [s.python, "make_figures.py", "--results", str(s.results), "--figures",
                                      str(s.figures)])
    return b.plan


class _Builder:
    """A plan as it is built, step kind by step kind in run order, with what the steps share: the run's
    dataset and assets overrides, the protocols' sizes, and which step writes each model's training and
    K profile (a later step needs it)."""

    def __init__(self, s: Settings, data: DatasetDecision, repo: Path):
        self.s, self.data, self.repo = s, data, repo
        self.plan = Plan(mode=s.mode)
        self.assets = [f"assets_dir={s.assets}"] if s.assets else []
        self.ds = dataset_overrides(data.ready) if data.ready else ["dataset=all"]
        # QUICK batches and ablates prefetching on one dataset (experiment=batch's own default is one:
        # humaneval); the full protocol on every dataset present
        self.batch_sets = (primary(data.batch_ready),) if s.one_dataset_steps and data.batch_ready else data.batch_ready
        self.prefetch_sets = (primary(data.ready),) if s.one_dataset_steps and data.ready else data.ready
        self.data_needs: tuple[str, ...] = ()
        self.trained: dict[str, str] = {}  # model -> the training step it needs
        self.sweeps: dict[tuple[str, str], str] = {}  # (model, tier) -> the step that writes its K profile
        self.own_sweeps: dict[tuple[str, str, str], str] = {}  # (model, tier, method) -> the step of a method's own profile
        self.sweep = protocol("k_sweep", s.quick, repo, s.sizes)
        self.main = protocol("main", s.quick, repo, s.sizes)
        self.batch = protocol("batch", s.quick, repo, s.sizes)

    # -- what the steps share
    def needs(self, model: str, *more: str) -> tuple[str, ...]:
        return (*self.data_needs, *((self.trained[model],) if model in self.trained else ()), *more)

    def trained_opt(self, model: str) -> list[str]:
        return [f"model.trained={str(self.s.trained).lower()}"] if is_tiny(model) else []

    def quick_over(self, p, experiment: str) -> list[str]:
        """A shortened run's protocol overrides of `experiment`; none for the full protocol."""
        return p.overrides(experiment) if self.s.quick else []

    def sweep_of(self, model: str, tier: str, method: str = "specter") -> tuple[str, ...]:
        """The step that writes the K profile a run of `method` reads (none when no step of this plan does)."""
        tier = self.s.profile_tier(tier)
        name = (self.sweeps.get((model, tier)) if is_method(method, reads_specter_profile=True)
                else self.own_sweeps.get((model, tier, method)))
        return (name,) if name else ()

    def run_argv(self, experiment: str, model: str, tier: str, method: str, *extra: str) -> list[str]:
        """A main-grid run (experiment=main) of one method; the ablation adds its override in `extra`."""
        s = self.s
        return [s.python, "run.py", f"experiment={experiment}", f"model={model}", f"memory={tier}", f"method={method}",
                f"hardware={s.method_hardware(method)}", *self.ds, *self.trained_opt(model),
                *self.quick_over(self.main, "main"), *self.assets, *_profile_args(s, model, tier, method), *extra]

    # -- the steps, in run order
    def datasets_and_training(self) -> None:
        s, py = self.s, self.s.python
        prepare = [py, "-m", "initialization.prepare_datasets", "--datasets", s.dataset]
        datasets_step = self.plan.add("datasets", "datasets", prepare + (["--assets", s.assets] if s.assets else []))
        self.data_needs = (datasets_step.name,)
        for m in s.models:
            if not (is_tiny(m) and s.trained):
                continue
            folder = s.home / "models" / f"{m}-trained"
            step = self.plan.add("train", f"train-{m}", [py, "-m", "initialization.train_tiny", m, "--no-progress"],
                                 checks=(Check("trained", folder),), model=m)
            self.trained[m] = step.name

    def k_sweeps(self) -> None:
        """Specter's K profile per model and tier; a method with a K range of its own sweeps it too."""
        s, py, sweep, n_ds = self.s, self.s.python, self.sweep, len(self.data.ready)
        for m in s.models:
            for tier in s.sweep_tiers:
                out = s.results / "k_sweep" / f"{m}-{tier}-{s.hardware}"
                self.sweeps[(m, tier)] = self.plan.add("k_sweep", f"k_sweep-{m}-{tier}",
                         [py, "run.py", "experiment=k_sweep", f"model={m}", f"memory={tier}", f"hardware={s.hardware}",
                          *self.ds, *self.trained_opt(m), *self.quick_over(sweep, "k_sweep"), *self.assets,
                          f"output_dir={out}"],
                         needs=self.needs(m), checks=(Check("k_sweep", out),),
                         records=n_ds * sweep.num_prompts * sweep.repeats * len(sweep.k_values),
                         units=len(sweep.k_values), model=m, method="specter").name
                # a method with a K range of its own sweeps that range in the full protocol; a shortened one
                # sweeps every speculative method over the same K set (method.k_range), as long as Specter's
                for method in (x for x in s.methods if is_method(x, own_k_profile=True)):
                    out = _k_profile(s, m, tier, method).parent
                    k_range = len(sweep.k_values) if s.quick else len(
                        (yaml.safe_load((self.repo / "conf" / "method" / f"{method}.yaml").read_text()) or {})
                        .get("k_range") or ())
                    own_range = ["method.k_range=[" + ",".join(map(str, sweep.k_values)) + "]"] if s.quick else []
                    self.own_sweeps[(m, tier, method)] = self.plan.add(
                        "k_sweep", f"k_sweep-{m}-{tier}-{method}",
                        [py, "run.py", "experiment=k_sweep", f"method={method}", f"model={m}", f"memory={tier}",
                         f"hardware={s.hardware}", *self.ds, *self.trained_opt(m),
                         *[o for o in self.quick_over(sweep, "k_sweep") if not o.startswith("k_sweep.values=")],
                         *own_range, *self.assets, f"output_dir={out}"],
                        needs=self.needs(m), checks=(Check("k_sweep", out),),
                        records=n_ds * sweep.num_prompts * sweep.repeats * k_range, units=k_range, model=m,
                        method=method).name

    def main_grid(self) -> None:
        s, main, data = self.s, self.main, self.data
        for m in s.models:
            for tier in s.tiers:
                # a tiny model's methods all fit one process: a cell; a real model's do not (each fills the tier's
                # GPU budget), so each method keeps a step of its own there
                inside = [x for x in s.methods if not is_method(x, out_of_process=True)] if is_tiny(m) else []
                _cell_step(self.plan, s, m, tier, inside, self.ds, self.assets, self.trained_opt(m),
                           self.quick_over(main, "main"), main, data, needs=lambda *more, m=m: self.needs(m, *more),
                           sweeps={x: self.sweep_of(m, tier, x) for x in inside})
                for method in (x for x in s.methods if x not in inside):
                    out = s.results / "main" / f"{m}-{method}-{tier}"
                    self.plan.add("main", f"main-{m}-{tier}-{method}",
                                  self.run_argv("main", m, tier, method, f"output_dir={out}"),
                                  needs=self.needs(m, *self.sweep_of(m, tier, method)),
                                  checks=(Check("run", out, data.ready),),
                                  records=len(data.ready) * main.num_prompts * main.repeats, model=m, method=method)

    def staging_ablation(self) -> None:
        """The same runs with method.staging_buffers=0 (QUICK and REFERENCE: the first model's low tier)."""
        s, main, data = self.s, self.main, self.data
        for m in s.models[:1] if s.quick else s.models:
            for tier in ("low",) if s.quick else s.tiers:
                for method in (x for x in s.methods if is_method(x, owns_cache=True, preset_of=None)):
                    out = s.results / "ablation" / "staging0" / f"{m}-{method}-{tier}"
                    self.plan.add("ablation", f"ablation-staging0-{m}-{tier}-{method}",
                                  self.run_argv("main", m, tier, method, "method.staging_buffers=0", f"output_dir={out}"),
                                  needs=self.needs(m, *self.sweep_of(m, tier, method)),
                                  checks=(Check("run", out, data.ready),),
                                  records=len(data.ready) * main.num_prompts * main.repeats, model=m, method=method)

    def batching(self) -> None:
        s, batch, py = self.s, self.batch, self.s.python
        ds_batch = dataset_overrides(self.batch_sets) if self.batch_sets else []
        if not (self.repo / "conf" / "experiment" / "batch.yaml").is_file():
            self.plan.notes.append("batch: conf/experiment/batch.yaml not found; Figs. 15/16 and Table 3 will be skipped")
            return
        if not ds_batch:
            self.plan.notes.append(f"batch: no dataset yields {batch.num_prompts} prompts; Figs. 15/16 and Table 3 "
                                   "will be skipped")
            return
        for m in s.batch_models:
            for method in s.batch_methods:
                if method not in s.methods:
                    continue
                extra, more = [], ()
                if is_method(method, tunes_k=True):
                    extra, more = _profile_args(s, m, "high", method), self.sweep_of(m, "high", method)
                hw = s.method_hardware(method)
                out = s.results / "batch" / f"{m}-{method}-high-{hw}"
                self.plan.add("batch", f"batch-{m}-{method}",
                              [py, "run.py", "experiment=batch", f"model={m}", "memory=high", f"method={method}",
                               f"hardware={hw}", *ds_batch, *self.trained_opt(m), *self.quick_over(batch, "batch"),
                               *self.assets, *extra, f"output_dir={out}"],
                              needs=self.needs(m, *more), checks=(Check("batch", out),),
                              records=len(self.batch_sets) * batch.num_prompts * len(batch.batch_sizes),
                              units=len(batch.batch_sizes), model=m, method=method)

    def trace(self) -> None:
        """The planner timeline: one traced Specter run per model (CPU only: its windows are timed on the host)."""
        s, py = self.s, self.s.python
        trace_ok = "specter" in s.methods and s.hardware != "cuda" and \
            "trace_windows" in {f.name for f in fields(SpecterMethodConfig)}
        if not trace_ok:
            self.plan.notes.append("trace: no method.trace_windows (or HARDWARE=cuda, or no specter in METHODS); the "
                                   "planner timeline (Figs. 8/9) will be skipped")
            return
        trace_ds = primary(self.data.ready)
        for m in s.models:
            out = s.results / "trace" / f"{m}-specter-low"
            self.plan.add("trace", f"trace-{m}",
                          [py, "run.py", f"model={m}", "memory=low", "method=specter", f"hardware={s.hardware}",
                           f"dataset={trace_ds}", "num_prompts=1", "repeats=1", *self.trained_opt(m), *self.assets,
                           f"k_profile={_k_profile(s, m, 'low')}", "method.trace_windows=true", f"output_dir={out}"],
                          needs=self.needs(m, *self.sweep_of(m, "low")),
                          checks=(Check("trace", out, (trace_ds,)),), records=1, model=m, method="specter")

    def benchmarks(self) -> None:
        """The draft kernel; on the tiny models the verification schedule, the prefetch ablation and the projection."""
        s, py, plan = self.s, self.s.python, self.plan
        bench = s.results / "bench"
        plan.add("bench", "bench-draft-kernel",
                 [py, "-m", "scripts.bench_draft_kernel", *(["--quick", "--dtype", "float32"] if s.quick else []),
                  str(bench / "draft_kernel.csv")], checks=(Check("csv", bench / "draft_kernel.csv"),))
        tiny = [m for m in s.models if is_tiny(m)]
        if not tiny:
            plan.notes.append("bench-verify, bench-prefetch: tiny models only (MODELS has none)")
            return
        untrained = [] if s.trained else ["--untrained"]
        tiny_needs = tuple(self.trained[m] for m in tiny if m in self.trained)
        verify = ["--memory", "low", "--K", "4", "8", "16", "--reps", "3"] if s.quick else []
        plan.add("bench", "bench-verify",
                 [py, "-m", "scripts.bench_verify", "--models", *tiny, *verify, "--hardware", s.hardware, *untrained,
                  "--out", str(bench / "verify_schedule.csv")],
                 needs=tiny_needs, checks=(Check("csv", bench / "verify_schedule.csv"),), units=len(tiny))
        pre = protocol("prefetch", s.quick, self.repo, s.sizes)
        quick_pre = ["--memory", "low", "--num-prompts", str(pre.num_prompts), "--max-new-tokens",
                     str(pre.max_new_tokens)] if s.quick else []
        plan.add("bench", "bench-prefetch",
                 [py, "-m", "scripts.bench_methods", "--suite", "prefetch", "--models", *tiny, *quick_pre,
                  "--datasets", ",".join(self.prefetch_sets) or "humaneval", "--hardware", s.hardware, *untrained,
                  *(["--assets", s.assets] if s.assets else []), "--out", str(bench)],
                 needs=(*self.data_needs, *tiny_needs), checks=(Check("csv", bench / "bench_methods.csv"),),
                 records=len(tiny) * 5 * len(self.prefetch_sets) * pre.num_prompts * pre.repeats, units=len(tiny) * 5)
        if s.hardware != "cuda":  # the projection runs the tiny proxies on a virtual clock (no device)
            _projection_step(plan, s, tiny_needs)


def _projection_step(plan: Plan, s: Settings, needs: tuple[str, ...]) -> None:
    cells = s.results / "project"
    plan.add("project", "project",  # with the batching (Table 3's models, high tier) and α-curve steps
             [s.python, "-m", "specter.experiments.projection_grid", "--results", str(s.results), "--batch", "--alpha"],
             needs=needs,
             checks=(*(Check("csv", cells / f"{r}-{t}-a100_40gb_pcie4" / "projection.csv")
                       for r in ("dsv2", "qwen15moe", "phi35moe") for t in ("high", "low")),
                     *(Check("csv", cells / f"{r}-high-a100_40gb_pcie4" / "batch_projection.csv")
                       for r in ("dsv2", "qwen15moe")),
                     *(Check("csv", cells / f"{r}-high-a100_40gb_pcie4" / "alpha_curve.csv")
                       for r in ("dsv2", "qwen15moe", "phi35moe"))),
             units=6)


def _cell_step(plan: Plan, s: Settings, model: str, tier: str, inside: list[str], ds: list[str], assets: list[str],
               trained: list[str], quick: list[str], main, data: DatasetDecision, needs,
               sweeps: dict[str, tuple[str, ...]]) -> None:
    """One main-grid cell (model x tier): the methods `inside` in one experiment=cell step, measured
    interleaved record by record in one process (specter/experiments/cell.py). Specter and MoE-Spec read
    Specter's K profile (k_profile=), a method with a profile of its own reads that (cell.k_profiles)."""
    if not inside:
        return
    profiled = [m for m in inside if is_method(m, reads_specter_profile=True)]
    extra = [f"k_profile={_k_profile(s, model, tier)}"] if profiled else []
    extra += [f"+cell.k_profiles.{m}={_k_profile(s, model, tier, m)}" for m in inside if is_method(m, own_k_profile=True)]
    other_hw = {m: s.method_hardware(m) for m in inside if s.method_hardware(m) != s.hardware}
    hw = [f"+cell.hardware.{m}={h}" for m, h in other_hw.items()]  # a typed dict takes new keys with +
    out = s.results / "main" / f"{model}-{{method}}-{tier}"
    plan.add("main", f"main-{model}-{tier}",
             [s.python, "run.py", "experiment=cell", f"model={model}", f"memory={tier}", f"hardware={s.hardware}",
              "cell.methods=[" + ",".join(inside) + "]", *hw, *ds, *trained, *quick, *assets, *extra,
              f"output_dir='{out}'"],
             needs=needs(*sorted({n for m in inside for n in sweeps.get(m, ())})),
             checks=tuple(Check("run", s.results / "main" / f"{model}-{m}-{tier}", data.ready) for m in inside),
             records=len(data.ready) * main.num_prompts * main.repeats * len(inside), units=len(inside),
             model=model, method=",".join(inside))


def _multirun_grid(plan: Plan, s: Settings, ds: list[str], assets: list[str], trained: dict[str, str],
                   data: DatasetDecision) -> dict[tuple[str, str], str]:
    """LAUNCHER=slurm|local: the grid as Hydra multiruns, one per kind of job (tiny and real models apart)."""
    py, launcher = s.python, f"hydra/launcher={s.launcher}"
    sweep, main = protocol("k_sweep", s.quick, sizes=s.sizes), protocol("main", s.quick, sizes=s.sizes)
    over = (lambda p, e: p.overrides(e)) if s.quick else (lambda p, e: [])
    profile_tier = "low" if s.quick else "${memory.name}"
    profiled = [m for m in s.methods if is_method(m, reads_specter_profile=True)]
    others = [m for m in s.methods if m not in (*profiled, "target_only")]
    sweeps: dict[tuple[str, str], str] = {}
    for group, models in (("tiny", [m for m in s.models if is_tiny(m)]), ("real", [m for m in s.models
                                                                                  if not is_tiny(m)])):
        if not models:
            continue
        topt = [f"model.trained={str(s.trained).lower()}"] if group == "tiny" else []
        needs = (plan.steps[0].name, *(trained[m] for m in models if m in trained))
        common = [f"model={','.join(models)}", *ds, *topt]
        checks = tuple(Check("k_sweep", s.results / "k_sweep" / f"{m}-{t}-{s.hardware}")
                       for m in models for t in s.sweep_tiers)
        k = plan.add("k_sweep", f"k_sweep-{group}",
                     [py, "run.py", "-m", launcher, "experiment=k_sweep", *common, f"memory={','.join(s.sweep_tiers)}",
                      f"hardware={s.hardware}", *over(sweep, "k_sweep"), *assets,
                      f"output_dir={s.results}/k_sweep/" + "${model.name}-${memory.name}-${hardware.name}"],
                     needs=needs, checks=checks, units=len(checks) * len(sweep.k_values),
                     records=len(checks) * len(data.ready) * sweep.num_prompts * sweep.repeats * len(sweep.k_values))
        sweeps.update({(m, t): k.name for m in models for t in s.sweep_tiers})

        def grid(name: str, methods: list[str], hardware: str, *extra: str, after: tuple[str, ...] = ()) -> None:
            checks = tuple(Check("run", s.results / "main" / f"{m}-{meth}-{t}", data.ready)
                           for m in models for meth in methods for t in s.tiers)
            plan.add("main", name,
                     [py, "run.py", "-m", launcher, "experiment=main", *common, f"memory={','.join(s.tiers)}",
                      f"method={','.join(methods)}", f"hardware={hardware}", *over(main, "main"), *assets, *extra,
                      f"output_dir={s.results}/main/" + "${model.name}-${method.name}-${memory.name}"],
                     needs=(*needs, *after), checks=checks, units=len(checks),
                     records=len(checks) * len(data.ready) * main.num_prompts * main.repeats)

        if profiled:
            grid(f"main-{group}-specter", profiled, s.hardware,
                 f"k_profile={s.results}/k_sweep/" + "${model.name}-" + profile_tier + "-${hardware.name}/k_profile.json",
                 after=(k.name,))
        if "target_only" in s.methods:
            grid(f"main-{group}-target_only", ["target_only"], s.method_hardware("target_only"))
        if others:
            grid(f"main-{group}-others", others, s.hardware)
    return sweeps
