"""The compact causal LM: embedding -> L x (norm, attention, residual, norm, MLP/MoE, residual) -> norm -> head.

    input_ids [B, T] ──embed──▶ x [N=B·T, H]
        for each layer:  x += attn(norm(x), step)      step = positions past..past+T-1 of the cache
                         x += mlp(norm(x))             MoE blocks call the block's experts module
    logits = head(norm(x[last rows]))                  [B, T or 1, V]

Built over an already-loaded transformers model (`build_compact(model)`): every weight is the
model's own tensor (q/k/v and gate/up are fused into one buffer that the model's parameters are
re-pointed into). `forward(input_ids, cache)` appends T positions to a `StaticKVCache`;
`cache.rollback(n)` forgets positions. Shapes per phase are fixed by (B, T), so a one-token step,
a (K+1)-token verification window and a B×(K+1) batch each have one static shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from specter.models.compact.attention import GQAAttention, MLAAttention, Step
from specter.models.compact.cache import StaticKVCache
from specter.models.compact.moe import DeepSeekMoE, DenseMLP, PhiMoE, QwenMoE
from specter.models.compact.ops import Proj, Rope, causal_mask, gated_mlp, norm_of, proj, rope_tables

SUPPORTED = ("deepseek_v2", "qwen2_moe", "phimoe")


@dataclass
class CompactLayer:
    attn_norm: object
    attn: object
    mlp_norm: object
    mlp: object


class CompactCausalLM:
    """Decoder over a transformers model's tensors; `__call__` is a drop-in for the decoding loops
    (`model(input_ids=..., cache=StaticKVCache)` returning an object with `.logits`)."""

    def __init__(self, model: torch.nn.Module, max_length: int | None = None, compact_experts: bool = True):
        config = model.config
        if config.model_type not in SUPPORTED:
            raise ValueError(f"no compact decode path for {config.model_type!r}; supported: {SUPPORTED}")
        self.hf = model
        self.config = config
        inner = model.model
        self.embed = inner.embed_tokens.weight  # [V, H]
        param = next(model.parameters())
        self.device, self.dtype = self.embed.device, param.dtype
        length = max_length or min(4096, int(getattr(config, "max_position_embeddings", 4096)))
        self.mla = mla = config.model_type == "deepseek_v2"
        self.rotary = inner.rotary_emb
        cos, sin = rope_tables(self.rotary, length, self.device, self.dtype, complex_form=mla)
        self.rope = Rope(cos, sin, interleaved=mla)  # shared by every layer; extended in place
        self.window = self._sliding_window()
        self.layers = [self._layer(i, layer, compact_experts) for i, layer in enumerate(inner.layers)]
        self.norm = norm_of(inner.norm)
        self.head: Proj = proj(model.lm_head)
        self.num_layers = len(self.layers)
        self.static = None  # a StaticStep one-token forwards go through (static.use_static_step)
        if mla:
            self.kv_heads = 1  # the latent cache: [c | k_pe] per position, values are a view of c
            self.key_dim = config.kv_lora_rank + config.qk_rope_head_dim
            self.value_dim = 0
        else:
            self.kv_heads = config.num_key_value_heads
            self.key_dim = self.value_dim = self._head_dim()

    # -- construction -----------------------------------------------------------------------------
    def _sliding_window(self) -> int | None:
        """One window for every layer (PhiMoE's `sliding_window`), or None; per-layer mixes are refused."""
        c = self.config
        types = getattr(c, "layer_types", None)
        if types and len(set(types)) > 1:
            raise NotImplementedError(f"{c.model_type}: mixed sliding/full attention layers ({sorted(set(types))}) "
                                      "have no compact decode path; use the transformers path")
        if types and types[0] == "full_attention":
            return None
        window = getattr(c, "sliding_window", None)
        if types and types[0] == "sliding_attention" or c.model_type == "phimoe":
            return int(window) if window else None
        return None

    def _head_dim(self) -> int:
        c = self.config
        return int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)

    def _layer(self, i: int, layer: torch.nn.Module, compact_experts: bool) -> CompactLayer:
        c = self.config
        if c.model_type == "deepseek_v2":
            attn = MLAAttention(layer.self_attn, i, self.rope, c)
        else:
            attn = GQAAttention(layer.self_attn, i, self.rope, c.num_attention_heads, c.num_key_value_heads,
                                self._head_dim())
        return CompactLayer(norm_of(layer.input_layernorm), attn, norm_of(layer.post_attention_layernorm),
                            self._mlp(layer, compact_experts))

    def _mlp(self, layer: torch.nn.Module, compact_experts: bool):
        c = self.config
        block = getattr(layer, "mlp", None)
        if block is None:
            block = layer.block_sparse_moe
        if not hasattr(block, "experts"):
            return DenseMLP(gated_mlp(block))
        kind = {"qwen2_moe": QwenMoE, "deepseek_v2": DeepSeekMoE, "phimoe": PhiMoE}[c.model_type]
        return kind(block, c, compact_experts)

    # -- caches -----------------------------------------------------------------------------------
    def new_cache(self, capacity: int, batch: int = 1, grow: bool = True) -> StaticKVCache:
        if self.static is not None:
            return self.static.cache(capacity, batch)
        return StaticKVCache(self.num_layers, batch, self.kv_heads, self.key_dim, self.value_dim, capacity,
                             self.device, self.dtype, grow=grow)

    # -- forward ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: StaticKVCache, last_only: bool = False) -> torch.Tensor:
        """input_ids [B, T] at positions cache.length.. -> logits [B, T, V] (or [B, 1, V] with last_only)."""
        b, t = input_ids.shape
        if self.static is not None and b == 1 and t == 1:
            return self.static(input_ids, cache)  # [1, 1, V]
        past = cache.length
        if past + t > self.rope.length:
            self.rope.cos, self.rope.sin = rope_tables(self.rotary, max(past + t, 2 * self.rope.length), self.device,
                                                       self.dtype, complex_form=self.mla)
        cache.reserve(t)
        cos, sin = self.rope.tables(past, t)  # [T, 1, D] each
        step = Step(b, t, past, cos, sin, causal_mask(past, t, input_ids.device, self.dtype, self.window), cache,
                    self.window)
        x = self.embed[input_ids.reshape(-1)]  # [N, H]
        for layer in self.layers:
            x = x + layer.attn(layer.attn_norm(x), step)
            x = x + layer.mlp(layer.mlp_norm(x))
        cache.advance(t)
        if last_only:
            x = x.view(b, t, -1)[:, -1]  # [B, H]
            return self.head(self.norm(x)).view(b, 1, -1)  # [B, 1, V]
        return self.head(self.norm(x)).view(b, t, -1)  # [B, T, V]

    def __call__(self, input_ids: torch.Tensor, cache: StaticKVCache | None = None, use_cache: bool = True,
                 logits_to_keep: int = 0, position_ids: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None) -> SimpleNamespace:
        if position_ids is not None or attention_mask is not None:  # never silently drop a batch's padding
            raise ValueError("the compact decoder takes no position_ids/attention_mask (one shared length per "
                             "cache); batched decoding with padding runs on the transformers model")
        if cache is None:
            cache = self.new_cache(input_ids.shape[1])
        return SimpleNamespace(logits=self.forward(input_ids, cache, last_only=logits_to_keep == 1), cache=cache)


def build_compact(model: torch.nn.Module, max_length: int | None = None,
                  compact_experts: bool = True) -> CompactCausalLM:
    """The compact decoder over `model` (place the model on its device first: weights are shared)."""
    return CompactCausalLM(model.eval(), max_length=max_length, compact_experts=compact_experts)
