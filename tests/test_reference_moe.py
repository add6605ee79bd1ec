"""The one MoE reference against an independent oracle: transformers' own experts modules."""

from __future__ import annotations

import pytest
import torch

from specter.kernels.reference import expert_ffn, moe_reference
from specter.models.tiny import make_config

EXPERTS = {
    "tiny_qwen": "transformers.models.qwen2_moe.modeling_qwen2_moe:Qwen2MoeExperts",
    "tiny_dsv2": "transformers.models.deepseek_v2.modeling_deepseek_v2:DeepseekV2Experts",
    "tiny_phi": "transformers.models.phimoe.modeling_phimoe:PhimoeExperts",
}


def _hf_experts(name: str) -> torch.nn.Module:
    import importlib

    module, _, cls = EXPERTS[name].partition(":")
    config = make_config(name, experts_implementation="eager")  # transformers' per-expert loop, not a fused kernel
    experts = getattr(importlib.import_module(module), cls)(config).float()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return experts.eval()


@pytest.mark.parametrize("name", sorted(EXPERTS))
@pytest.mark.parametrize("T", [1, 5, 33])
def test_reference_matches_transformers_experts(name, T):
    experts = _hf_experts(name)
    E, k = experts.gate_up_proj.shape[0], make_config(name).num_experts_per_tok
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, experts.gate_up_proj.shape[-1], generator=g)  # [T, H]
    topk_idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])  # [T, k]
    topk_w = torch.rand(T, k, generator=g)  # [T, k]
    with torch.no_grad():
        expected = experts(x, topk_idx, topk_w)
        got = moe_reference(x, topk_idx, topk_w, experts.gate_up_proj, experts.down_proj, experts.act_fn)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_expert_ffn_is_a_gated_mlp():
    """Hand-checkable case: identity-like weights give silu(x)·x back through the down projection."""
    x = torch.tensor([[1.0, -2.0]])  # [1, H=2]
    gate_up = torch.cat([torch.eye(2), torch.eye(2)])  # [2I=4, H]: gate = x, up = x
    down = torch.eye(2)  # [H, I]
    out = expert_ffn(x, gate_up, down, torch.nn.functional.silu)
    torch.testing.assert_close(out, torch.nn.functional.silu(x) * x)


def test_masked_routes_are_skipped():
    """Ids equal to E (transformers' masked routes) contribute nothing."""
    E, H, I = 4, 8, 6
    g = torch.Generator().manual_seed(1)
    gu, dn = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    x = torch.randn(3, H, generator=g)
    idx = torch.tensor([[0, E], [E, E], [2, 1]])
    w = torch.ones(3, 2)
    out = moe_reference(x, idx, w, gu, dn, torch.nn.functional.silu)
    assert torch.equal(out[1], torch.zeros(H))
    torch.testing.assert_close(out[0], expert_ffn(x[:1], gu[0], dn[0], torch.nn.functional.silu)[0])
