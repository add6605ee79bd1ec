"""The projection's draft and K (specter/projection/profile.py, steps.py): the paper's GPTQ draft by default and
named in every speculative row; K profiled on the modelled device, the fastest of the set, with the default K
as a second row; the profile's prompts are not the measured ones; a K swapped on a built method projects what
a method built at that K does."""

from __future__ import annotations

import pytest

from conftest import compose, run_cli

FAST = ["experiment=project", "model=dsv2", "memory=high", "project.prompts=1", "project.new_tokens=10",
        "project.warmup_tokens=4", "project.profile_prompts=1", "project.tokens=8", "project.routes=independent",
        "project.quant=rtn", "project.methods=[target_only,specter]", "project.profile=[specter]",
        "project.k_values=[2,8,16]"]


@pytest.fixture(scope="module")
def profiled():
    from specter.experiments.project import project_rows

    return project_rows(compose(FAST))


def test_gptq_is_the_projections_default_draft():
    from specter.projection.steps import draft_name

    assert compose(["experiment=project"]).project.quant == "gptq"
    assert compose([]).project.quant == "gptq"  # the schema's default agrees with the experiment's
    assert draft_name("gptq") == "GPTQ INT4 g128" and draft_name("rtn") == "RTN INT4 g128"


def test_the_profiled_row_runs_the_fastest_K_of_the_set(profiled):
    rows, facts = profiled
    prof = [r for r in facts["profile_rows"] if r["method"] == "specter"]
    assert [int(r["K"]) for r in prof] == [2, 8, 16]
    assert [r["chosen"] for r in prof].count("true") == 1
    fastest = next(r for r in prof if r["chosen"] == "true")
    assert float(fastest["tpot_ms"]) == min(float(r["tpot_ms"]) for r in prof)  # (the CSV's 4 decimals may tie)
    assert float(fastest["tpot_ms"]) < max(float(r["tpot_ms"]) for r in prof)
    specter = [r for r in rows if r["method"] == "specter" and r["source"] == "engine"]
    assert [r["k_source"] for r in specter] == ["profiled", "paper"]
    assert specter[0]["K"] == fastest["K"] and specter[1]["K"] == "16"  # DeepSeek-V2-Lite's K in the paper
    assert all(r["draft"] == "RTN INT4 g128" for r in specter)
    target = next(r for r in rows if r["method"] == "target_only")
    assert target["draft"] == "" and target["K"] == "" and target["k_source"] == ""


def test_the_table_names_device_and_draft(profiled):
    from specter.experiments.project import format_profiles, format_projection

    rows, facts = profiled
    text = format_projection(rows, facts)
    assert "on a100_40gb_pcie4, draft RTN INT4 g128" in text.splitlines()[0]
    assert "16 paper" in text and "profiled" in text
    head = format_profiles(facts["profile_rows"]).splitlines()[0]
    assert "a100_40gb_pcie4" in head and "RTN INT4 g128" in head


def test_profile_prompts_are_not_the_measured_ones(profiled):
    px = profiled[1]["px"]
    measured, held = px.prompts(0, 1), px.prompts(1, 1)
    assert not bool((measured[0] == held[0]).all())
    assert bool((px.prompts(0, 2)[1] == held[0]).all())  # the next held-out document


def test_best_K_breaks_ties_toward_the_smaller_K():
    from specter.projection.engine_run import Projected
    from specter.projection.profile import Profile

    def p(t):
        return Projected("specter", t, None, None, None, 1, 0)

    assert Profile("specter", [(4, p(0.02)), (8, p(0.01)), (16, p(0.01))]).best == 8
    assert Profile("specter", [(4, p(None)), (8, p(0.03))]).best == 8
    with pytest.raises(ValueError, match="no K"):
        Profile("specter", [(4, p(None))]).best


def test_a_swapped_K_projects_what_a_method_built_at_that_K_does(profiled):
    from specter.projection.engine_run import close, measure, open_method, set_K

    px, cm = profiled[1]["px"], profiled[1]["cm"]
    prompts = px.prompts(0, 1)
    session = open_method(px.config("specter"), px.checkpoint, cm)
    try:
        set_K(session, 4)
        swapped = measure(session, "specter", 0, prompts, 10, 4)
    finally:
        close(session)
    built = px.measure(cm, "specter", 4, prompts)
    assert swapped.K == built.K == 4 and swapped.tokens == built.tokens
    assert swapped.tpot == pytest.approx(built.tpot, rel=1e-9)
    assert swapped.loads_per_token == pytest.approx(built.loads_per_token, rel=1e-9)


@pytest.mark.parametrize("override,message", [
    ("project.quant=awq", "project.quant='awq' is not gptq"),
    ("project.profile=[offload_ar]", "project.profile: ['offload_ar'] not one of"),
    ("project.k_values=[0,4]", "project.k_values must be a non-empty list of integers >= 1"),
    ("project.alpha_drafts=[gptq5g128]", "project.alpha_drafts: draft 'gptq5g128'"),
    ("project.batch_sizes=[]", "project.batch_sizes must be a non-empty list"),
])
def test_bad_project_keys_are_one_clear_line(override, message):
    from specter.assembly.config import ConfigError
    from specter.projection.steps import check_project

    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_project(compose(["experiment=project", override]))


def test_qwen_prints_gptq_draft_rows_and_a_profiled_K_row(tmp_path):
    """The issue's command, shortened (one prompt, fewer tokens and K values), at its default draft."""
    r = run_cli(["experiment=project", "model=qwen15moe", "memory=high", "project.methods=[offload_ar,specter]",
                 "project.prompts=1", "project.new_tokens=8", "project.warmup_tokens=4", "project.profile_prompts=1",
                 "project.k_values=[4,8]", "project.tokens=8", "progress=false", f"output_dir={tmp_path}"], timeout=1800)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [line for line in r.stdout.splitlines() if line.strip().startswith("specter ")]
    assert any("GPTQ INT4 g128" in line and "profiled" in line for line in lines), r.stdout
    assert any("GPTQ INT4 g128" in line and "8 paper" in line for line in lines), r.stdout
    assert (tmp_path / "k_profile.csv").is_file()


def test_bad_project_key_exits_2_with_one_line(tmp_path):
    r = run_cli(["experiment=project", "model=dsv2", "project.alpha_drafts=[gptq9g128]", f"output_dir={tmp_path}"])
    assert r.returncode == 2
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and "project.alpha_drafts" in err[0], r.stderr
