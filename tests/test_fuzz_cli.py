"""Property test over the command line: any override drawn from the schema's own fields (right or
wrong type, in or out of range) either runs a 4-token job (exit 0) or is refused with exactly one
`specter: error:` line and exit status 2 — never a traceback.

Keys come from the dataclasses in specter/harness/schema.py; values from the field's type plus
wrong-typed and boundary values. Settings that only scale the work (repeats, warm-up, threads) are
drawn small; settings that would build or train a model (model.trained) or compile one
(method.decode_path=compiled) are left out, since their cost, not their parsing, is what they test.
Runs in-process (`specter.harness.cli.main`), bounded by max_examples.
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
from specter.harness import schema  # noqa: E402

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
