"""Property test over the command line: any override drawn from the schema's own fields (right or
wrong type, in or out of range) either runs a 4-token job (exit 0) or is refused with exactly one
`specter: error:` line and exit status 2 — never a traceback.

Keys come from the dataclasses in specter/assembly/schema.py; values from the field's type plus
wrong-typed and boundary values. Settings that only scale the work (repeats, warm-up, threads) are
drawn small; settings that would build or train a model (model.trained) or compile one
(method.decode_path=compiled) are left out, since their cost, not their parsing, is what they test.
Runs in-process (`specter.experiments.cli.main`), bounded by max_examples.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import typing

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from conftest import FIXTURES, cli_in_process  # noqa: E402
from specter.assembly import schema  # noqa: E402

BASE = ["model=tiny_qwen", "method=target_only", "dataset=gsm8k", "num_prompts=1", "max_new_tokens=4",
        "warmup_tokens=0", "progress=false", f"assets_dir={FIXTURES / 'datasets'}"]
GROUPS = {"": schema.RunConfig, "model.": schema.ModelConfig, "memory.": schema.MemoryConfig,
          "hardware.": schema.HardwareConfig, "method.": schema.MethodConfig}
# paths the job writes to, or settings whose cost is building/training/compiling a model
LEFT_OUT = {"output_dir", "experiment", "model.trained", "assets_dir"}
SMALL = {"repeats": (0, 2), "warmup_tokens": (-1, 4), "num_prompts": (-1, 2), "hardware.threads": (-1, 2),
         "hardware.ratio_probe_steps": (-1, 4), "max_new_tokens": (-1, 4)}
STRINGS = {"method.decode_path": ["hf", "compact"], "hardware.dtype": ["float32", "bfloat16", "float16"],
           "hardware.link": ["cpu", "emulated", "cuda"], "hardware.device": ["cpu", "cuda"]}


def _scalar_fields() -> dict[str, type]:
    """Every scalar field of the schema, as `key -> type` (Optional[X] -> X)."""
    hints = {}
    for prefix, cls in GROUPS.items():
        types = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind = types[f.name]
            args = [a for a in typing.get_args(kind) if a is not type(None)]
            if typing.get_origin(kind) is typing.Union and len(args) == 1:
                kind = args[0]
            if kind in (int, float, bool, str) and f"{prefix}{f.name}" not in LEFT_OUT:
                hints[f"{prefix}{f.name}"] = kind
    return hints


FIELDS = _scalar_fields()
WRONG = st.sampled_from(["abc", "''", "null", "[1,2]", "{a:1}", "1e999", "-1", "0", "nan", "inf", "true"])
TEXT = st.text(alphabet="abcxyz_019-.", min_size=1, max_size=8)


def value_for(key: str) -> st.SearchStrategy[str]:
    kind = FIELDS[key]
    if key in SMALL:
        lo, hi = SMALL[key]
        good = st.integers(lo, hi).map(str)
    elif kind is bool:
        good = st.sampled_from(["true", "false"])
    elif kind is int:
        good = st.one_of(st.integers(-5, 40), st.sampled_from([2**31, 2**70])).map(str)
    elif kind is float:
        good = st.one_of(st.floats(-2, 5, allow_nan=False), st.sampled_from([float("inf"), float("nan")])).map(
            lambda v: repr(v).replace("inf", "inf").replace("nan", "nan"))
    else:
        good = st.one_of(st.sampled_from(STRINGS.get(key, [])), TEXT) if key in STRINGS else TEXT
    return st.one_of(good, good, WRONG)


OVERRIDE = st.sampled_from(sorted(FIELDS)).flatmap(lambda key: value_for(key).map(lambda v: f"{key}={v}"))


@settings(max_examples=int(os.environ.get("SPECTER_FUZZ_EXAMPLES", "40")), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(overrides=st.lists(OVERRIDE, min_size=1, max_size=3))
def test_any_schema_override_runs_or_fails_in_one_line(overrides, capsys):
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            rc, out, err = cli_in_process([*BASE, f"output_dir={tmp}/o", *overrides], capsys)
        finally:  # verbose=true sets SPECTER_VERBOSE for the process
            os.environ.clear()
            os.environ.update(env)
    event(f"exit status {rc}")  # pytest --hypothesis-show-statistics: how many ran, how many were refused
    assert "Traceback" not in out + err, (overrides, err[-3000:])
    errors = [line for line in err.splitlines() if line.startswith("specter: error:")]
    if rc == 0:
        assert not errors, (overrides, errors)
    else:
        assert rc == 2 and len(errors) == 1, (overrides, rc, err[-3000:])


# ---------------------------------------------------------------------------------- the other entry points
# Each property below draws arguments for one entry point and holds it to the same rule: exit 0, or
# exactly one `<prog>: error:` line and exit status 2, never a traceback. They stop before any model
# loads (a refused override, an unknown checkpoint), so they check argument handling, not decoding.
FEW = int(os.environ.get("SPECTER_FUZZ_EXAMPLES", "40"))
FUZZ = settings(max_examples=FEW, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
NUMBERS = st.one_of(st.integers(-2**70, 2**70).map(str), st.floats().map(repr),
                    st.sampled_from(["", "nan", "inf", "-inf", "1e999", "0x10", "1_000", " 8", "eight", "8.5"]))


def _one_rule(rc: int, out: str, err: str, prog: str, args) -> None:
    assert "Traceback" not in out + err, (args, err[-3000:])
    errors = [line for line in err.splitlines() if line.startswith(f"{prog}: error:")]
    if rc == 0:
        assert not errors, (args, errors)
    else:
        assert rc == 2 and len(errors) == 1, (args, rc, err[-3000:])


SERVE_OPTION = st.tuples(st.sampled_from(["--port", "--max-batch", "--max-queue", "--drain-timeout", "--host"]),
                         st.one_of(NUMBERS, st.sampled_from(["127.0.0.1", "::1", "localhost", "0.0.0.0", "not a host"])))


@FUZZ
@given(options=st.lists(SERVE_OPTION, max_size=4))
def test_serve_options_are_one_line(options, capsys):
    from specter import cli

    args = ["serve", *[x for pair in options for x in pair], "model=tiny_dsv2", "max_new_tokens=0"]
    rc = cli.main(args)  # max_new_tokens=0 is refused after the options: nothing binds or loads
    out, err = capsys.readouterr()
    _one_rule(rc, out, err, "specter", args)
    assert rc == 2


@FUZZ
@given(prompt=st.text(st.characters(codec=None, exclude_categories=()), max_size=12),
       flag=st.sampled_from(["", "ignore_eos=true", "ignore_eos=maybe"]))
def test_generate_prompts_are_one_line(prompt, flag, capsys):
    from specter import cli

    args = ["generate", f"prompt={prompt}", *([flag] if flag else []), "model=tiny_dsv2", "max_new_tokens=0"]
    rc = cli.main(args)  # any prompt (lone surrogates too) reaches only the refused override
    out, err = capsys.readouterr()
    _one_rule(rc, out, err, "specter", args)
    assert rc == 2


def _path(tmp: str, kind: str) -> str:
    """A path of `kind` under `tmp`: missing, a file, a folder, or under a file."""
    from pathlib import Path

    root = Path(tmp)
    (root / "file").write_text("x\n")
    (root / "dir").mkdir(exist_ok=True)
    return str({"missing": root / "missing", "file": root / "file", "dir": root / "dir",
                "under_file": root / "file" / "sub"}[kind])


PATH_KIND = st.sampled_from(["missing", "file", "dir", "under_file"])


@FUZZ
@given(tokens=NUMBERS, K=NUMBERS, text=st.one_of(PATH_KIND, st.sampled_from(["gsm8k", "HE", "nope", ","])),
       out=PATH_KIND)
def test_routing_stats_arguments_are_one_line(tokens, K, text, out, capsys):
    from specter import routing_stats

    with tempfile.TemporaryDirectory() as tmp:
        text_arg = _path(tmp, text) if text in ("missing", "file", "dir", "under_file") else text
        args = ["no_such_model", "--tokens", tokens, "--K", K, "--text", text_arg, "--out", _path(tmp, out)]
        rc = routing_stats.main(args)  # at best it reaches the unknown checkpoint
    out_, err = capsys.readouterr()
    _one_rule(rc, out_, err, "routing_stats", args)
    assert rc == 2


@FUZZ
@given(only=st.lists(st.sampled_from(["k_sweep", "timeline", "tpot_grid", "bogus", "", "TPOT"]), max_size=3),
       dpi=NUMBERS, results=PATH_KIND, figures=PATH_KIND)
def test_make_figures_arguments_are_one_line(only, dpi, results, figures, capsys):
    from specter.figures.cli import main

    with tempfile.TemporaryDirectory() as tmp:
        args = ["--results", _path(tmp, results), "--figures", _path(tmp, figures), "--dpi", dpi,
                *(["--only", *only] if only else [])]
        rc = main(args)
    out, err = capsys.readouterr()
    _one_rule(rc, out, err, "make_figures.py", args)


DEVICE_VALUE = st.one_of(st.floats(), st.integers(-10, 10**13), st.booleans(), st.none(), st.text(max_size=4),
                         st.lists(st.integers(), max_size=2))


@FUZZ
@given(entries=st.dictionaries(st.sampled_from(["hbm_bandwidth", "hbm_efficiency", "peak_fp16", "peak_int4_effective",
                                                "launch_overhead", "h2d_bandwidth", "h2d_latency", "d2h_bandwidth",
                                                "d2h_latency", "name"]),
                               st.one_of(st.fixed_dictionaries({"value": DEVICE_VALUE},
                                                               optional={"source": st.one_of(st.text(max_size=3),
                                                                                             st.none())}),
                                         DEVICE_VALUE), min_size=7))
def test_device_files_load_or_refuse(entries):
    """A device file is a Device of finite positive values, each with a source, or one ConfigError."""
    import math
    from pathlib import Path

    import yaml

    from specter.assembly.config_error import ConfigError
    from specter.projection.cost_model import load_device

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "device.yaml"
        path.write_text(yaml.safe_dump(entries))
        try:
            device = load_device(path)
        except ConfigError as err:
            assert "\n" not in str(err)
            return
    values = [v for k, v in vars(device).items() if k not in ("name", "sources")]
    assert all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in values)
    assert 0 < device.hbm_efficiency <= 1 and all(s.strip() for s in device.sources.values())


@FUZZ
@given(kinds=st.fixed_dictionaries({}, optional={k: PATH_KIND for k in ("RESULTS", "SPECTER_HOME", "FIGURES", "LOGS")}))
def test_reproduce_folders_are_checked(kinds):
    from pathlib import Path

    from specter.reproduce.settings import SettingsError, read_settings

    with tempfile.TemporaryDirectory() as tmp:
        env = {"QUICK": "1", "CHECK": "1", "MODELS": "tiny_dsv2", "METHODS": "specter",
               **{k: _path(tmp, v) for k, v in kinds.items()}}
        try:
            s = read_settings(env)
        except SettingsError:
            assert any(v in ("file", "under_file") for v in kinds.values())
            return
        for folder in (s.results, s.figures, s.logs, s.home):
            assert not Path(folder).exists() or Path(folder).is_dir()
