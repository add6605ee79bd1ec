"""Each method's facts are declared once, on its registry line (specter/assembly/runners.py), and every place
that lists methods asks the registry: a new method is its YAML, its class (with its schema) and one registry
line, and the plan, the projection and the reproduction driver all see it."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from specter.assembly.methods import Method, OffloadAR
from specter.assembly.runners import (MethodFacts, is_method, known_runners, method_facts, method_names,
                                     register_method, unregister_method)
from specter.assembly.schema import METHOD_SCHEMAS, OffloadMethodConfig, register_method_schema

REPO = Path(__file__).resolve().parents[1]


# -- the toy method, in exactly three places ---------------------------------------------------------------
# 1. its YAML (written into a copy of conf/ by the fixture)
TOY_YAML = """\
defaults:
  - /schema/method/toy@_here_
  - _self_
name: toy
runner: {runner}
speculative: false
schedule: expert
"""


# 2. its class, with its schema
@dataclass
class ToyMethodConfig(OffloadMethodConfig):
    toy_knob: int = 1


class Toy(OffloadAR):
    """Autoregressive offloading under another name."""

    name = "toy"


# 3. its registry line (in the registry itself it is one line of `_METHODS`)
TOY = MethodFacts(f"{__name__}:Toy", "a toy", owns_cache=True)


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """A copy of the repository's conf/ and scripts/ with the toy's YAML; the toy's schema and registry line."""
    repo = tmp_path / "repo"
    shutil.copytree(REPO / "conf", repo / "conf")
    (repo / "conf" / "method" / "toy.yaml").write_text(TOY_YAML.format(runner=TOY.runner))
    register_method_schema("toy", ToyMethodConfig)
    register_method("toy", TOY)
    import specter.assembly.compose as compose

    monkeypatch.setattr(compose, "CONF_DIR", repo / "conf")
    yield repo
    unregister_method("toy")
    METHOD_SCHEMAS.pop("toy", None)


def test_the_registry_lists_every_config_and_class():
    """Every conf/method/*.yaml is a registered method whose YAML names the registry's runner, and whose class
    carries that name; the YAML's `speculative` is the registry's."""
    import importlib

    import yaml

    configs = {p.stem: yaml.safe_load(p.read_text()) for p in (REPO / "conf" / "method").glob("*.yaml")}
    assert set(configs) == set(method_names())
    for name, data in configs.items():
        facts = method_facts(name)
        assert data["runner"] == facts.runner, name
        assert bool(data["speculative"]) == facts.speculative, name
        module, _, cls = facts.runner.partition(":")
        assert getattr(importlib.import_module(module), cls).name == name
    assert known_runners() == {f.runner for f in map(method_facts, configs)}


def test_the_groups_the_name_tuples_held():
    """The registry's queries give the groups the module-level name tuples used to spell out."""
    assert method_names(owns_cache=True) == ("offload_ar", "mo_sc", "mo_sm", "specter", "moe_spec", "specmoeoff",
                                             "specmoeoff_artifact")
    assert method_names(external=True) == ("transformers", "llamacpp", "vllm")
    assert method_names(tunes_k=True) == ("specter", "specmoeoff")
    assert method_names(reads_specter_profile=True) == ("specter", "moe_spec")
    assert method_names(own_k_profile=True) == ("specmoeoff",)
    assert method_names(out_of_process=True) == ("vllm",)
    assert method_names(places_itself=True) == ("target_only", "transformers", "llamacpp", "vllm")
    assert set(method_names(projected=True)) == {"target_only", "offload_ar", "mo_sc", "mo_sm", "specmoeoff",
                                                 "moe_spec", "specter"}
    assert set(method_names(batched_projection=True)) == {"specter", "specmoeoff", "moe_spec"}
    assert set(method_names(owns_cache=True, preset_of=None)) == {"offload_ar", "mo_sc", "mo_sm", "specmoeoff",
                                                                  "specter", "moe_spec"}
    assert method_names(slots_rule="all") == ("target_only",)
    with pytest.raises(TypeError):
        method_names(no_such_fact=True)


def test_a_toy_method_in_three_places_is_seen_everywhere(toy):
    """The toy's YAML, class (with schema) and registry line are all it takes: the config composes and builds
    through the registry, and the plan, the projection, the load-ratio sweep and the reproduction driver list it."""
    from specter.assembly.compose import compose
    from specter.experiments.load_ratio_sweep import linkless
    from specter.assembly.plan import plan_rows
    from specter.projection.engine_run import proxy_overrides
    from specter.projection.steps import check_project
    from specter.reproduce.datasets import decide
    from specter.reproduce.plan import build_plan
    from specter.reproduce.settings import read_settings

    cfg = compose(["experiment=plan", "model=dsv2", "memory=high", "method=toy"])
    assert cfg.method.toy_knob == 1 and cfg.method.runner == TOY.runner

    # the plan sizes it by its slots rule, like offload_ar
    rows, _ = plan_rows(cfg)
    mine = [(r.batch, r.resident, r.staging, r.total) for r in rows if r.method == "toy"]
    ar = [(r.batch, r.resident, r.staging, r.total) for r in rows if r.method == "offload_ar"]
    assert mine and mine == ar

    # the projection takes it, and gives it the plan's slots
    project = compose(["experiment=project", "model=dsv2", "memory=high", "project.methods=[toy]",
                       "project.profile=[]", "project.batch_methods=[]", "project.alpha_methods=[]"])
    check_project(project)
    assert "memory.resident_experts=5" in proxy_overrides("tiny_dsv2", False, "high", "toy", (5, 2), None, "rtn", 0)
    assert not linkless("toy")

    # the reproduction driver runs it: in the tiny model's cell, and in the staging ablation
    env = {"METHODS": "offload_ar toy", "MODELS": "tiny_dsv2", "QUICK": "1", "DRY_RUN": "1",
           "SPECTER_HOME": str(toy / "home"), "RESULTS": str(toy / "results"), "ASSETS": str(REPO / "tests" /
                                                                                             "fixtures" / "datasets")}
    settings = read_settings(env, repo=toy)
    assert "toy" in settings.methods
    data = decide(settings.dataset, settings.assets_dir, 1, 1)
    names = build_plan(settings, data, repo=toy).names()
    assert "quick.ablation-staging0-tiny_dsv2-low-toy" in names, "\n".join(names)
    assert any(n.startswith("quick.main-tiny_dsv2-") for n in names)


def test_a_toy_method_builds_through_the_registry(toy, tiny_checkpoint):
    """`build_method` instantiates the toy from its registry line; its facts are its class's."""
    from specter.assembly.compose import compose
    from specter.assembly.methods import build_method

    cfg = compose(["model=tiny_dsv2", "method=toy", "hardware=cpu", "memory=high"])
    method = build_method(cfg, tiny_checkpoint("tiny_dsv2"))
    try:
        assert isinstance(method, Toy) and method.facts is TOY and method.rt is not None
        assert method.engine is None and method.batch_engines == () and method.K is None
    finally:
        method.close()
    assert is_method("toy", owns_cache=True) and not is_method("toy", speculative=True)


def test_no_method_is_probed_with_getattr_or_hasattr():
    """A method's facts and what it exposes are declared (the registry, `Method`'s attributes), never probed."""
    res = subprocess.run(["grep", "-rnE", r"(getattr|hasattr)\(method\b", "specter", "baselines"], cwd=REPO,
                         capture_output=True, text=True)
    assert res.returncode == 1 and not res.stdout, res.stdout


def test_no_module_level_tuple_of_method_names():
    """Outside the registry, no module keeps a module-level tuple (or set, or dict) of method names; a DEFAULT_*
    selection (which methods an experiment runs when none are named) is a choice, not a fact. A lone "specter" or
    "transformers" is a package's name (a list of source trees, of library versions)."""
    methods = set(method_names())
    packages = {"specter", "transformers"}
    assignment = re.compile(r"^[A-Z_]+\s*(:[^=]*)?=\s*(\(|\[|\{|frozenset\()")
    skip = {REPO / "specter" / "assembly" / "runners.py",
            # the display names and the paper's legend order: figure facts until the registry carries a label
            REPO / "specter" / "figures" / "labels.py", REPO / "specter" / "figures" / "common.py"}
    found = []
    for root in ("specter", "baselines"):
        for path in sorted((REPO / root).rglob("*.py")):
            if path in skip:
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if not assignment.match(line) or line.startswith("DEFAULT_"):
                    continue
                named = set(re.findall(r"[\"']([a-z0-9_]+)[\"']", line)) & methods
                if len(named) > 1 or named - packages:
                    found.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
    assert not found, "\n".join(found)


def test_figures_ask_the_registry_which_methods_are_lossy_and_read_specters_profile():
    """A method registered in one line is lossy (legend mark, kept out of lossless means) and reads Specter's
    K profile in the figures as the registry says, with no list in the figures to extend."""
    from specter.assembly.runners import MethodFacts, register_method, unregister_method
    from specter.figures.k_sweep import profile_of
    from specter.figures.labels import is_lossy

    register_method("toy_lossy", MethodFacts("specter.assembly.methods:Specter", speculative=True, owns_cache=True,
                                             lossy=True, reads_k_profile=True))
    try:
        assert is_lossy("toy_lossy") and is_lossy("toy_lossy[budget=4]") and not is_lossy("specter")
        profiles = {("tiny_dsv2", "low", "specter"): (16, "inside")}
        assert profile_of(profiles, "tiny_dsv2", "low", "toy_lossy")[0] == 16
    finally:
        unregister_method("toy_lossy")
    assert not is_lossy("toy_lossy") and profile_of(profiles, "tiny_dsv2", "low", "toy_lossy")[0] is None


def test_the_base_class_exposes_defaults():
    """What a method exposes has a default on `Method`, so no caller needs to probe for it."""
    for attr in ("rt", "engine", "route_log", "K", "draft_moe", "draft_model"):
        assert getattr(Method, attr) is None
    assert Method.batch_engines == ()


def test_nothing_assigns_to_a_built_method_or_engine_from_outside():
    """A method, its engines and its runtime are instrumented by handing them an `Instruments` value
    (`Method.instrument`, `build_method(..., instruments=)`): outside the engine's own package, no code assigns
    their attributes (runtime, link, meter, clocks, engines, K, spec)."""
    import ast

    attrs = {"rt", "link", "meter", "step_clock", "commit_clock", "recorder", "engine", "batch_engines", "K", "spec",
             "route_log", "draft_moe", "draft_model", "instruments"}
    owners = {"method", "engine", "rt", "session", "runtime"}
    found = []
    for root in ("specter", "baselines"):
        for path in sorted((REPO / root).rglob("*.py")):
            parts = path.relative_to(REPO).parts
            if "figures" in parts or "speculative" in parts:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                targets = node.targets if isinstance(node, ast.Assign) else \
                    [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
                for t in targets:
                    if not (isinstance(t, ast.Attribute) and t.attr in attrs):
                        continue
                    chain, r = [], t.value
                    while isinstance(r, ast.Attribute):
                        chain.append(r.attr)
                        r = r.value
                    if isinstance(r, ast.Name) and r.id not in ("self", "cls") and (r.id in owners or
                                                                                   set(chain) & {"engine", "rt"}):
                        found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(t)}")
    assert not found, "\n".join(found)


def test_instruments_reach_the_runtime_and_every_engine(tiny_checkpoint):
    """`build_method(..., instruments=)` installs the link and meter on the runtime and the clocks on the engines,
    those built later included; with none, the method keeps its own."""
    from specter.assembly.compose import compose
    from specter.assembly.methods import build_method
    from specter.offload.instruments import Instruments
    from specter.offload.link import ImmediateLink

    cfg = compose(["model=tiny_dsv2", "method=specter", "method.quant=rtn", "hardware=cpu", "memory=high"])
    plain = build_method(cfg, tiny_checkpoint("tiny_dsv2"))
    try:
        assert plain.rt.moe.meter is None and plain.engine.step_clock is None
    finally:
        plain.close()

    class Meter:
        def __getattr__(self, name):
            return lambda *args, **kwargs: None

    link, meter = ImmediateLink(), Meter()
    clock = lambda: 0.0  # noqa: E731
    method = build_method(cfg, tiny_checkpoint("tiny_dsv2"),
                          instruments=Instruments(link=link, meter=meter, step_clock=clock))
    try:
        assert method.rt.link is link and method.rt.cache.link is link and method.rt.moe.meter is meter
        for engine in [method.engine, *method.build_batch_engines()]:
            assert engine.rt is method.rt and engine.recorder.link is link and engine.step_clock is clock
        method.set_draft_length(2)
        assert method.engine.K == 2 and method.engine.step_clock is clock and method.engine.recorder.link is link
    finally:
        method.close()
