"""Every in-process offloading method on the compact decode path keeps target-only's greedy tokens.

The compact decoder (specter.models.compact) replaces transformers' modules for single-request
forwards; the MoE hook is unchanged, so offloading, the ELB, expert-wise verification and the
INT4 draft run as on the transformers path. Each method's greedy output must equal the plain
transformers model's on all three tiny architectures, both tiers.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_MODELS, compose

from specter.assembly.config import ConfigError
from specter.assembly.methods import build_method
from specter.models.compact import CompactCausalLM
from specter.models.loading import load_full_model
from specter.speculative.autoregressive import generate_autoregressive
from specter.speculative.sampling import SamplingParams

LINK = ["hardware=emulated", "hardware.bandwidth_gbps=2", "hardware.latency_us=5"]
PROMPTS = (torch.tensor([[17, 300, 45, 8, 512, 9, 77]]), torch.tensor([[3]]))
N = 20
METHODS = {"offload_ar": [], "mo_sc": [], "mo_sm": [], "specter": ["method.quant=rtn"],
           "specmoeoff": ["method.quant=rtn"]}


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    cache = {}

    def get(model, i):
        if (model, i) not in cache:
            full = load_full_model(tiny_checkpoint(model), torch.float32, torch.device("cpu"))
            cache[(model, i)] = generate_autoregressive(full, PROMPTS[i], N, SamplingParams())
        return cache[(model, i)]

    return get


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("memory", ["high", "low"])
@pytest.mark.parametrize("model", TINY_MODELS)
def test_compact_path_keeps_target_only_tokens(method, memory, model, tiny_checkpoint, reference):
    cfg = compose([f"model={model}", f"memory={memory}", f"method={method}", *LINK, f"max_new_tokens={N}",
                   "method.decode_path=compact", *METHODS[method]])
    m = build_method(cfg, tiny_checkpoint(model))
    try:
        assert isinstance(m.rt.forward_model, CompactCausalLM) and m.static_fields()["decode_path"] == "compact"
        for i, prompt in enumerate(PROMPTS):
            m.reset()
            gen = m.generate(prompt, N, torch.Generator().manual_seed(0))
            assert gen.tokens == reference(model, i), f"prompt {i}"
            assert gen.stats["h2d_bytes"] > 0
            if method in ("specter", "specmoeoff"):
                assert gen.stats["drafted_tokens"] > 0
        if method == "offload_ar":  # one route-log window per decode step, as on the transformers path
            assert len({r["window"] for r in m.route_log.rows()}) == N
    finally:
        m.close()


def test_batched_decoding_stays_on_transformers_modules(tiny_checkpoint):
    """Batches carry per-row positions and masks: the batched engine keeps the transformers model, and
    the compact decoder refuses them rather than dropping the padding."""
    cfg = compose(["model=tiny_qwen", "memory=low", "method=specter", *LINK, "max_new_tokens=8",
                   "method.decode_path=compact", "method.quant=rtn"])
    m = build_method(cfg, tiny_checkpoint("tiny_qwen"))
    try:
        engine = m.make_engine()
        engine.begin_run()
        assert engine.model is m.rt.model and engine.kv.model is m.rt.model
        engine.begin_run(engine.sequence_rows)  # one request: the decode path's own cache
        assert engine.new_rows([]).model is m.rt.forward_model is not m.rt.model
        with pytest.raises(ValueError, match="attention_mask"):
            m.rt.forward_model(input_ids=PROMPTS[0], attention_mask=torch.ones_like(PROMPTS[0]))
    finally:
        m.close()


def test_moe_spec_refuses_the_compact_path(tiny_checkpoint):
    cfg = compose(["model=tiny_qwen", "memory=low", "method=moe_spec", *LINK, "method.decode_path=compact"])
    with pytest.raises(ConfigError, match="decode_path=hf"):
        build_method(cfg, tiny_checkpoint("tiny_qwen"))


def test_the_link_is_timed_from_the_step_of_the_decode_path_in_use(tiny_checkpoint):
    """r is relative to the layer step the run takes: on the compact path the probe decodes with
    the compact decoder (several times fewer operators), and the calibration cache keeps one step
    per decode path."""
    from specter.assembly.load_ratio import probe_decoder
    from specter.offload.calibrate import measure_layer_step

    ckpt = tiny_checkpoint("tiny_qwen")
    hf = probe_decoder(ckpt, torch.float32, torch.device("cpu"), "hf")
    compact = probe_decoder(ckpt, torch.float32, torch.device("cpu"), "compact")
    assert isinstance(compact, CompactCausalLM) and compact.hf is hf
    assert measure_layer_step(compact, steps=12) > 0 and measure_layer_step(hf, steps=12) > 0
    cfg = compose(["model=tiny_qwen", "memory=low", "method=offload_ar", "hardware=emulated",
                   "method.decode_path=compact", "max_new_tokens=4"])
    m = build_method(cfg, ckpt)
    try:
        assert m.rt.link_params.calibration_file.endswith("-compact.json")
    finally:
        m.close()
