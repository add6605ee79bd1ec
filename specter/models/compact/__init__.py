"""A compact decode path for DeepSeek-V2, Qwen2-MoE and PhiMoE checkpoints.

Own small modules over the loaded transformers model's tensors (no copy of the weights), a
preallocated KV cache rolled back by length, fused projections (q/k/v, gate/up, router + shared
expert), and the MoE blocks' experts modules called as `experts(hidden, topk_idx, topk_w)`.
transformers stays the reference: tests/test_compact_vs_hf.py compares both paths.

    from specter.models.compact import build_compact, generate_compact
    compact = build_compact(model)                     # model: a loaded transformers model
    tokens = generate_compact(compact, prompt_ids, 64, pick=lambda logits: int(logits.argmax()))

Modules: `cache` (StaticKVCache), `ops` (projections, norms, rope, attention, experts),
`attention` (GQA, MLA), `moe` (routers + blocks), `model` (the decoder), `decode` (loops),
`static` (the one-token step with static shapes that torch.compile traces and CUDA graphs replay).
"""

from specter.models.compact.cache import StaticKVCache
from specter.models.compact.decode import generate_compact, verify_window
from specter.models.compact.model import SUPPORTED, CompactCausalLM, build_compact

__all__ = ["SUPPORTED", "CompactCausalLM", "StaticKVCache", "build_compact", "generate_compact", "verify_window"]
