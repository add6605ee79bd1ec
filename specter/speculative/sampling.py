"""Speculative sampling: filtering, drafting and verification of one window of K draft tokens.

Names follow the paper: ``p`` = target probabilities, ``q`` = draft probabilities, K = draft
length. For a window the draft proposes ``x_0..x_{K-1}`` (``x_i ~ q_i``) and the target scores
K+1 positions in one pass (``p_0..p_K``). Verification keeps the longest accepted prefix and
emits one more token: a *correction* at the first rejection or a *bonus* from ``p_K``::

    greedy (temperature 0):  accept x_i while x_i == argmax p_i
    stochastic:              accept x_i iff U_i <= min(1, p_i(x_i) / q_i(x_i)),  U_i ~ U[0, 1)
                             first rejection at n -> sample norm(max(p_n - q_n, 0))
                             all K accepted       -> sample p_K

The stochastic rule emits every token with exactly the target's distribution. Each verifier
reads its result back to the host in a single device->host copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """Decoding settings shared by draft and target; ``temperature == 0`` means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filtering

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Filtered, renormalized probabilities ``[..., V]`` (fp32): temperature, then top-k, then top-p.

    Greedy params give the one-hot distribution of the argmax. Top-k keeps every logit tied
    with the k-th largest; top-p keeps the smallest most-probable prefix whose mass reaches
    ``top_p`` (the most probable token is always kept).
    """
    x = logits.float()
    if params.greedy:
        return torch.zeros_like(x).scatter_(-1, x.argmax(dim=-1, keepdim=True), 1.0)
    x = x / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(torch.softmax(x, dim=-1), dim=-1, descending=True)  # [..., V]
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [..., V] mass of strictly better tokens
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)  # back to vocab order
        x = x.masked_fill(drop, float("-inf"))
    return torch.softmax(x, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token id drawn from ``probs [V]`` (need not be normalized)."""
    return int(torch.multinomial(probs.float(), 1, generator=generator))


def draft_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Next draft token(s) from draft logits ``[..., V]`` without a host sync.

    Returns ``(tokens [...] long, q [..., V])``; greedy drafting returns the argmax and
    ``q = None`` (greedy verification never reads q).
    """
    if params.greedy:
        return logits.argmax(dim=-1), None
    q = logits_to_probs(logits, params)  # [..., V]
    flat = q.reshape(-1, q.shape[-1])  # [N, V]
    tokens = torch.multinomial(flat, 1, generator=generator).view(q.shape[:-1])  # [...]
    return tokens, q


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """Length of the all-true prefix of a 1-D bool tensor, as a 0-d long tensor on its device."""
    return torch.cumprod(mask.long(), dim=0).sum()


def greedy_verify(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Greedy verification: ``(num_accepted, next_token)``.

    ``draft_tokens [K]`` long, ``target_logits [K+1, V]``. The next token is the target argmax
    at the first mismatch (correction) or at position K (bonus).
    """
    K = draft_tokens.numel()
    target_ids = target_logits.argmax(dim=-1)  # [K+1]
    draft = draft_tokens.reshape(K).to(target_ids.device)
    n = _leading_true(target_ids[:K] == draft)  # [] accepted count
    next_token = target_ids.gather(0, n.view(1))  # [1] correction or bonus
    num_accepted, token = torch.cat([n.view(1), next_token]).tolist()  # the one D2H copy
    return num_accepted, token


def speculative_verify(
    draft_tokens: torch.Tensor,
    q: torch.Tensor,
    p: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Stochastic verification (speculative sampling): ``(num_accepted, next_token)``.

    ``draft_tokens [K]`` long with ``x_i ~ q_i``, ``q [K, V]`` draft and ``p [K+1, V]`` target
    probabilities. All K uniforms are drawn at once; the next token comes from
    ``norm(max(p_n - q_n, 0))`` at the first rejection n, or from ``p_K`` when all are accepted.
    """
    K = draft_tokens.numel()
    p = p.float()
    q = q.float().to(p.device)
    vocab = p.shape[-1]
    x = draft_tokens.reshape(K, 1).to(device=p.device, dtype=torch.long)  # [K, 1]
    p_x = p[:K].gather(1, x).squeeze(1)  # [K] p_i(x_i)
    q_x = q.gather(1, x).squeeze(1)  # [K] q_i(x_i)
    u = torch.rand(K, generator=generator, device=p.device)  # [K]
    accepted = u * q_x <= p_x  # [K] U <= p/q without dividing (U < 1, so the min(1, .) is implied)
    n = _leading_true(accepted)  # [] accepted count
    # A zero row after q makes row K of the residual p_K itself: the bonus needs no branch.
    q_ext = torch.cat([q, q.new_zeros(1, vocab)])  # [K+1, V]
    p_n = p.index_select(0, n.view(1))  # [1, V]
    residual = (p_n - q_ext.index_select(0, n.view(1))).clamp_(min=0)  # [1, V]
    # Rounding can leave no residual mass when p_n ~= q_n; p_n is then the exact answer.
    dist = torch.where(residual.sum() > 0, residual, p_n)  # [1, V]
    token = torch.multinomial(dist, 1, generator=generator)  # [1, 1]
    num_accepted, next_token = torch.cat([n.view(1), token.view(1)]).tolist()  # the one D2H copy
    return num_accepted, next_token


def verify_window(
    draft_tokens: torch.Tensor,
    q: torch.Tensor | None,
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Verify one window with the rule ``params`` selects; ``q`` is unused when greedy."""
    if params.greedy:
        return greedy_verify(draft_tokens, target_logits)
    if q is None:
        raise ValueError("stochastic verification needs the draft probabilities q")
    return speculative_verify(draft_tokens, q, logits_to_probs(target_logits, params), generator)


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Greedy argmax at temperature 0, else a sample from the filtered distribution."""
    if params.temperature == 0:
        return int(logits.argmax())
    return sample(logits_to_probs(logits.float(), params), generator)


def make_generator(device: torch.device | str, seed: int) -> torch.Generator:
    """A seeded generator on the device the sampling ops run on (CUDA ops reject a CPU generator)."""
    return torch.Generator(device=torch.device(device)).manual_seed(seed)
