"""Compact attention over the static KV cache: grouped-query attention (Qwen2-MoE, PhiMoE) and
DeepSeek-V2's multi-head latent attention (MLA), both reading the checkpoint's own tensors.

Every call receives a `Step`: the batch rows, the T new positions starting at the cache's
length, their rope tables and the causal mask (None for one token), built once per forward
and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specter.models.compact.cache import StaticKVCache
from specter.models.compact.ops import Proj, Rope, attend, cols, fuse, norm_of, proj, seq


@dataclass
class Step:
    batch: int
    t: int  # new positions per row
    past: int  # cached positions before them
    cos: torch.Tensor  # [T, 1, D_rope] (broadcast over heads)
    sin: torch.Tensor  # [T, 1, D_rope]
    mask: torch.Tensor | None  # additive [T, past+T], None when T == 1
    cache: StaticKVCache
    window: int | None = None  # sliding attention window (PhiMoE), None = full


@dataclass
class StaticTokens:
    """What every layer of one static step reads: the position and its rope rows, the mask, the buffers."""

    pos: torch.Tensor  # [1] int64, the position written this step
    cos: torch.Tensor  # [1, D_rope]
    sin: torch.Tensor  # [1, D_rope]
    mask: torch.Tensor  # [n] additive: 0 where the token attends, -inf elsewhere
    keys: list[torch.Tensor]  # L x [1, H_kv, S_max, D]
    values: list[torch.Tensor]  # L x [1, H_kv, S_max, D_v] (empty for MLA's latent cache)
    span: int  # n: attention reads positions 0..n-1 of the buffers


class GQAAttention:
    """q/k/v fused into one projection; rope on q and k together; SDPA with grouped heads."""

    def __init__(self, attn: torch.nn.Module, layer: int, rope: Rope, num_heads: int, kv_heads: int, head_dim: int):
        self.layer, self.rope = layer, rope
        self.qkv = fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o = proj(attn.o_proj)
        self.h, self.hkv, self.d = num_heads, kv_heads, head_dim
        self.scale = float(getattr(attn, "scaling", head_dim ** -0.5))

    def __call__(self, x: torch.Tensor, s: Step) -> torch.Tensor:  # x [N, H] -> [N, H]
        if s.batch == 1 and s.t == 1:
            return self.one_token(x, s)
        b, t, g = s.batch, s.t, self.h // self.hkv
        qkv = self.qkv(x).view(b, t, self.h + 2 * self.hkv, self.d)  # [B, T, Hq+2Hkv, D]
        qk = self.rope.apply(qkv[:, :, :self.h + self.hkv], s.cos, s.sin)  # [B, T, Hq+Hkv, D]
        k, v = s.cache.write(self.layer, qk[:, :, self.h:].transpose(1, 2),
                             qkv[:, :, self.h + self.hkv:].transpose(1, 2))  # [B, Hkv, past+T, D] each
        n_kv = k.shape[2]
        q = qk[:, :, :self.h].view(b, t, self.hkv, g, self.d).permute(0, 2, 3, 1, 4)  # [B, Hkv, g, T, D]
        o = attend(q.reshape(b * self.hkv, g * t, self.d), k.reshape(b * self.hkv, n_kv, self.d),
                   v.reshape(b * self.hkv, n_kv, self.d), s.mask, self.scale, t)  # [B*Hkv, g*T, D]
        o = o.view(b, self.hkv, g, t, self.d).permute(0, 3, 1, 2, 4)  # [B, T, Hkv, g, D]
        return self.o(o.reshape(b * t, self.h * self.d))  # [N, H]

    def one_token(self, x: torch.Tensor, s: Step) -> torch.Tensor:
        """The decode step (B = T = 1): every layout change is a view."""
        h, hkv, d = self.h, self.hkv, self.d
        qkv = self.qkv(x).view(h + 2 * hkv, d)  # [Hq+2Hkv, D]
        qk = self.rope.apply_rows(qkv[:h + hkv], s.cos[0], s.sin[0])  # [Hq+Hkv, D]
        cache, pos = s.cache, s.past
        keys, values = cache.keys[self.layer], cache.values[self.layer]  # [1, Hkv, S_max, D]
        seq(keys, pos, 1).copy_(qk[h:].view(1, hkv, 1, d))
        seq(values, pos, 1).copy_(qkv[h + hkv:].view(1, hkv, 1, d))
        lo = 0 if s.window is None else max(0, pos + 1 - s.window)  # first position inside the window
        k = seq(keys, lo, pos + 1 - lo)[0]  # [Hkv, pos+1-lo, D]
        v = seq(values, lo, pos + 1 - lo)[0]
        o = attend(qk[:h].view(hkv, h // hkv, d), k, v, None, self.scale, 1)  # [Hkv, g, D]
        return self.o(o.view(1, h * d))  # [1, H]

    def static_token(self, x: torch.Tensor, z: StaticTokens) -> torch.Tensor:
        """One token at the tensor position `z.pos` with static shapes and no host sync (compilable,
        CUDA-graph capturable): KV written by index, attention over the span z.span under `z.mask`."""
        h, hkv, d = self.h, self.hkv, self.d
        qkv = self.qkv(x).view(h + 2 * hkv, d)  # [Hq+2Hkv, D]
        qk = self.rope.apply_rows(qkv[:h + hkv], z.cos, z.sin)  # [Hq+Hkv, D]
        keys, values = z.keys[self.layer], z.values[self.layer]  # [1, Hkv, S_max, D] each
        # written on the buffers themselves, not on a view: a compiled write through a view of an
        # input copies the whole buffer (functionalization), twice, every step
        keys.index_copy_(2, z.pos, qk[h:].view(1, hkv, 1, d))
        values.index_copy_(2, z.pos, qkv[h + hkv:].view(1, hkv, 1, d))
        n = z.span
        o = attend(qk[:h].view(hkv, h // hkv, d), keys[0, :, :n], values[0, :, :n], z.mask[None], self.scale, 1)
        return self.o(o.view(1, h * d))  # [1, H]


class MLAAttention:
    """DeepSeek-V2 multi-head latent attention in its absorbed form over a latent cache.

    The cache holds what transformers caches: per position the normed latent c [kv_rank] and the
    rotated shared k_pe [rope], side by side in one key buffer `[B, 1, S, kv_rank + rope]`; the
    values are a view of its first kv_rank columns. kv_b_proj's key half is absorbed into the
    query (q_nope @ W_uk gives a query in latent space) and its value half is applied after
    attention, so no per-head key or value is ever materialised.

        a = [q_a | c | k_pe] = in_proj(x)           q_a/q and kv_a fused (one product)
        q = q_b(norm(q_a)) -> q_nope, q_pe          [B, T, Hq, nope], [B, T, Hq, rope]
        q_lat = q_nope @ W_uk                       [Hq, N, kv_rank]
        attend([q_lat | rope(q_pe)], cache[c | rope(k_pe)], cache[c])   one shared KV head
        o = (out @ W_uv^T) -> o_proj                [Hq, N, v] -> [N, H]
    """

    def __init__(self, attn: torch.nn.Module, layer: int, rope: Rope, config):
        self.layer, self.rope = layer, rope
        self.h = config.num_attention_heads
        self.nope, self.rope_dim, self.vdim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.rank = config.kv_lora_rank
        self.q_lora = getattr(config, "q_lora_rank", None)
        if self.q_lora:
            self.in_proj = fuse([attn.q_a_proj, attn.kv_a_proj_with_mqa])
            self.q_norm = norm_of(attn.q_a_layernorm)
            self.q_b: Proj | None = proj(attn.q_b_proj)
            self.q_width = self.q_lora
        else:
            self.in_proj = fuse([attn.q_proj, attn.kv_a_proj_with_mqa])
            self.q_b = None
            self.q_width = self.h * (self.nope + self.rope_dim)
        self.kv_norm = norm_of(attn.kv_a_layernorm)
        w = attn.kv_b_proj.weight.view(self.h, self.nope + self.vdim, self.rank)  # [Hq, nope+v, rank] (a view)
        self.w_uk = w[:, :self.nope]  # [Hq, nope, rank]
        self.w_uv_t = w[:, self.nope:].transpose(1, 2)  # [Hq, rank, v]
        self.o = proj(attn.o_proj)
        self.scale = float(attn.scaling)

    def __call__(self, x: torch.Tensor, s: Step) -> torch.Tensor:  # x [N, H] -> [N, H]
        if s.batch == 1 and s.t == 1:
            return self.one_token(x, s)
        n = x.shape[0]
        a = self.in_proj(x)  # [N, q_width + rank + rope]
        q = cols(a, 0, self.q_width)
        if self.q_b is not None:
            q = self.q_b(self.q_norm(q))  # [N, Hq*(nope+rope)]
        q = q.view(n, self.h, self.nope + self.rope_dim)  # [N, Hq, nope+rope]
        latent = self.kv_norm(cols(a, self.q_width, self.rank))  # [N, rank]
        k_pe = cols(a, self.q_width + self.rank, self.rope_dim).reshape(n, 1, self.rope_dim)  # [N, 1, rope]
        pe = self.rope.apply(torch.cat([q[..., self.nope:], k_pe], 1).view(s.batch, s.t, self.h + 1, self.rope_dim),
                             s.cos, s.sin)  # [B, T, Hq+1, rope]
        q_lat = torch.bmm(q[..., :self.nope].transpose(0, 1), self.w_uk)  # [Hq, N, rank]
        query = torch.cat([q_lat.view(self.h, s.batch, s.t, self.rank).permute(1, 0, 2, 3),
                           pe[:, :, :self.h].transpose(1, 2)], -1)  # [B, Hq, T, rank+rope]
        cache = s.cache
        slot = seq(cache.keys[self.layer], cache.length, s.t)  # [B, 1, T, rank+rope]
        slot[..., :self.rank].copy_(latent.view(s.batch, 1, s.t, self.rank))
        slot[..., self.rank:].copy_(pe[:, :, self.h:].transpose(1, 2))
        kv = seq(cache.keys[self.layer], 0, cache.length + s.t)[:, 0]  # [B, past+T, rank+rope]
        o = attend(query.view(s.batch, self.h * s.t, -1), kv, kv[..., :self.rank], s.mask, self.scale,
                   s.t)  # [B, Hq*T, rank]
        o = o.view(s.batch, self.h, s.t, self.rank).permute(1, 0, 2, 3)  # [Hq, B, T, rank]
        o = torch.bmm(o.reshape(self.h, n, self.rank), self.w_uv_t)  # [Hq, N, v]
        return self.o(o.transpose(0, 1).reshape(n, self.h * self.vdim))  # [N, H]

    def token_query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token's latent-space query [Hq, rank+rope] and its cache row [c | k_pe] [1, rank+rope]."""
        h, nope, rank = self.h, self.nope, self.rank
        a = self.in_proj(x)  # [1, q_width + rank + rope]
        q = cols(a, 0, self.q_width)
        if self.q_b is not None:
            q = self.q_b(self.q_norm(q))  # [1, Hq*(nope+rope)]
        q = q.view(h, nope + self.rope_dim)  # [Hq, nope+rope]
        latent = self.kv_norm(cols(a, self.q_width, rank))  # [1, rank]
        pe = self.rope.apply_rows(torch.cat([q[:, nope:], cols(a, self.q_width + rank, self.rope_dim)]),
                                  cos, sin)  # [Hq+1, rope]
        q_lat = torch.bmm(q[:, :nope].unsqueeze(1), self.w_uk)  # [Hq, 1, rank]
        return torch.cat([q_lat.view(h, rank), pe[:h]], -1), torch.cat([latent, pe[h:]], -1)

    def token_out(self, o: torch.Tensor) -> torch.Tensor:
        """Attention output in latent space [1, Hq, rank] -> [1, H] (W_uv, then o_proj)."""
        o = torch.bmm(o.view(self.h, 1, self.rank), self.w_uv_t)  # [Hq, 1, v]
        return self.o(o.view(1, self.h * self.vdim))  # [1, H]

    def one_token(self, x: torch.Tensor, s: Step) -> torch.Tensor:
        """The decode step (B = T = 1) with views only; the new [c | k_pe] written in one copy."""
        query, row = self.token_query(x, s.cos[0], s.sin[0])
        keys, pos = s.cache.keys[self.layer], s.past  # [1, 1, S_max, rank+rope]
        seq(keys, pos, 1).copy_(row.view(1, 1, 1, -1))
        kv = seq(keys, 0, pos + 1).view(1, pos + 1, -1)  # [1, pos+1, rank+rope]
        return self.token_out(attend(query.view(1, self.h, -1), kv, kv[..., :self.rank], None, self.scale, 1))

    def static_token(self, x: torch.Tensor, z: StaticTokens) -> torch.Tensor:
        """`one_token` at the tensor position `z.pos` (static shapes, no host sync)."""
        query, row = self.token_query(x, z.cos, z.sin)
        buf = z.keys[self.layer]  # [1, 1, S_max, rank+rope]
        buf.index_copy_(2, z.pos, row.view(1, 1, 1, -1))  # on the buffer itself (see GQAAttention.static_token)
        kv = buf[0, :, :z.span]  # [1, n, rank+rope]
        return self.token_out(attend(query.view(1, self.h, -1), kv, kv[..., :self.rank], z.mask[None], self.scale, 1))
