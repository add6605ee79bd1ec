"""The config is read once, into a frozen typed MethodSpec; the engine is built from the spec only."""

from __future__ import annotations

import dataclasses
import json

import pytest
from conftest import compose

from specter.assembly.config import ConfigError
from specter.assembly.runtime import method_spec
from specter.spec import MethodSpec

LINK = ["hardware=emulated", "hardware.bandwidth_gbps=2", "hardware.latency_us=5"]


def test_method_spec_is_frozen_typed_and_recordable():
    spec = method_spec(compose(["model=tiny_dsv2", "memory=low", "method=specter", "K=8", *LINK]))
    assert isinstance(spec, MethodSpec) and spec.K == 8 and spec.quant == "gptq" and spec.prefetch == "adaptive"
    assert spec.staging is None and spec.plan_cap is None and spec.link.kind == "emulated"
    assert spec.link.bandwidth_gbps == 2 and spec.device == "cpu" and spec.sequence_tokens > 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.K = 4  # type: ignore[misc]
    record = json.loads(json.dumps(spec.record()))  # plain values only: what env.json stores under "spec"
    assert record["K"] == 8 and record["planner"]["cold_start_frac"] == spec.planner.cold_start_frac


def test_autoregressive_methods_have_no_speculation_in_their_spec():
    spec = method_spec(compose(["model=tiny_qwen", "memory=high", "method=mo_sc", *LINK]))
    assert spec.K == 0 and spec.quant is None and spec.staging is None  # None: the one staging rule decides
    fixed = method_spec(compose(["model=tiny_qwen", "memory=high", "method=mo_sc", "method.staging_buffers=4", *LINK]))
    assert fixed.staging == 4  # the original's buffer_size, when asked for


def test_a_negative_staging_count_is_a_config_error():
    with pytest.raises(ConfigError, match="staging_buffers"):
        method_spec(compose(["model=tiny_dsv2", "method=specter", "method.staging_buffers=-1", *LINK]))
