"""Speculative sampling: filtering with one right answer, greedy and stochastic verification.

The stochastic tests check the defining property of speculative sampling: every emitted token
is distributed as the target p, whatever the draft q (p = target, q = draft).
"""

from __future__ import annotations

import pytest
import torch

from specter.speculative.sampling import (
    SamplingParams,
    draft_next,
    greedy_verify,
    logits_to_probs,
    sample,
    speculative_verify,
    verify_window,
)


def _tv(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Total variation between an empirical histogram and a distribution."""
    return 0.5 * float((counts.double() / counts.sum() - probs.double()).abs().sum())


# -- filtering ---------------------------------------------------------------------------------

def test_greedy_params_give_one_hot_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [3.0, 0.0, 0.0, 2.5]])
    probs = logits_to_probs(logits, SamplingParams())
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))


def test_temperature_scales_logits():
    logits = torch.tensor([1.0, 2.0, 0.5, -1.0])
    probs = logits_to_probs(logits, SamplingParams(temperature=0.5))
    torch.testing.assert_close(probs, torch.softmax(logits / 0.5, dim=-1))


def test_top_k_keeps_exactly_the_k_best():
    logits = torch.tensor([1.0, 5.0, 3.0, 4.0, 2.0])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    expected = torch.zeros(5)
    expected[[1, 3]] = torch.softmax(torch.tensor([5.0, 4.0]), dim=-1)
    torch.testing.assert_close(probs, expected)


def test_top_p_keeps_smallest_prefix_reaching_the_mass():
    target = torch.tensor([0.15, 0.5, 0.05, 0.3])  # sorted: 0.5, 0.3, 0.15, 0.05
    probs = logits_to_probs(target.log(), SamplingParams(temperature=1.0, top_p=0.7))
    torch.testing.assert_close(probs, torch.tensor([0.0, 0.625, 0.0, 0.375]))
    # A top_p below the best token's mass keeps that token alone.
    probs = logits_to_probs(target.log(), SamplingParams(temperature=1.0, top_p=0.2))
    assert torch.equal(probs, torch.tensor([0.0, 1.0, 0.0, 0.0]))


def test_top_k_is_applied_before_top_p():
    # After top-2 the best token holds 0.35 / 0.65 = 0.538 >= 0.5, so top-p keeps it alone;
    # top-p on the unfiltered distribution would have kept two tokens.
    target = torch.tensor([0.35, 0.3, 0.2, 0.15])
    probs = logits_to_probs(target.log(), SamplingParams(temperature=1.0, top_k=2, top_p=0.5))
    assert torch.equal(probs, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_filtering_rows_are_independent():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 11, generator=gen)  # [B, T, V]
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.9)
    batched = logits_to_probs(logits, params)
    for b in range(3):
        for t in range(4):
            torch.testing.assert_close(batched[b, t], logits_to_probs(logits[b, t], params))
    torch.testing.assert_close(batched.sum(-1), torch.ones(3, 4))


@pytest.mark.parametrize("kwargs", [{"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}])
def test_invalid_params_are_rejected(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_sample_and_draft_next_with_one_right_answer():
    assert sample(torch.tensor([0.0, 0.0, 1.0, 0.0])) == 2
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])  # [B, V]
    tokens, q = draft_next(logits, SamplingParams())
    assert tokens.tolist() == [1, 0] and q is None
    tokens, q = draft_next(logits, SamplingParams(temperature=1.0, top_k=1))
    assert tokens.tolist() == [1, 0]
    assert torch.equal(q, torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))


# -- greedy verification -----------------------------------------------------------------------

def _one_hot_logits(ids: list[int], vocab: int) -> torch.Tensor:
    logits = torch.zeros(len(ids), vocab)
    logits[torch.arange(len(ids)), torch.tensor(ids)] = 5.0
    return logits


def test_greedy_all_accepted_gives_bonus():
    draft = torch.tensor([3, 1, 4])
    assert greedy_verify(draft, _one_hot_logits([3, 1, 4, 2], 6)) == (3, 2)


def test_greedy_first_mismatch_gives_correction():
    draft = torch.tensor([3, 1, 4, 0])
    assert greedy_verify(draft, _one_hot_logits([3, 5, 4, 0, 2], 6)) == (1, 5)
    assert greedy_verify(draft, _one_hot_logits([2, 1, 4, 0, 2], 6)) == (0, 2)


def test_greedy_k1():
    assert greedy_verify(torch.tensor([4]), _one_hot_logits([4, 1], 6)) == (1, 1)
    assert greedy_verify(torch.tensor([4]), _one_hot_logits([0, 1], 6)) == (0, 0)


def _greedy_reference(draft: list[int], logits: torch.Tensor) -> tuple[int, int]:
    for i, x in enumerate(draft):
        best = int(logits[i].argmax())
        if best != x:
            return i, best
    return len(draft), int(logits[len(draft)].argmax())


@pytest.mark.parametrize("K", [1, 2, 5, 16])
@pytest.mark.parametrize("vocab", [3, 50])
def test_greedy_matches_loop_reference(K, vocab):
    gen = torch.Generator().manual_seed(K * 100 + vocab)
    for _ in range(20):
        logits = torch.randn(K + 1, vocab, generator=gen)
        draft = logits[:K].argmax(-1)
        cut = int(torch.randint(0, K + 1, (1,), generator=gen))  # force a mismatch at `cut` (if < K)
        if cut < K:
            draft[cut] = (draft[cut] + 1) % vocab
        assert greedy_verify(draft, logits) == _greedy_reference(draft.tolist(), logits)


# -- stochastic verification -------------------------------------------------------------------

def _speculative_reference(draft, q, p, generator) -> tuple[int, int]:
    """Token-by-token speculative sampling drawing the same random numbers as the fast path."""
    K = len(draft)
    u = torch.rand(K, generator=generator)
    for i, x in enumerate(draft):
        if not u[i] <= min(1.0, float(p[i, x]) / float(q[i, x])):
            residual = (p[i] - q[i]).clamp(min=0)
            dist = residual if float(residual.sum()) > 0 else p[i]
            return i, int(torch.multinomial(dist.unsqueeze(0), 1, generator=generator))
    return K, int(torch.multinomial(p[K].unsqueeze(0), 1, generator=generator))


@pytest.mark.parametrize("K", [1, 3, 8])
@pytest.mark.parametrize("vocab", [5, 40])
def test_speculative_matches_sequential_reference(K, vocab):
    gen = torch.Generator().manual_seed(7 * K + vocab)
    for trial in range(25):
        p = torch.softmax(torch.randn(K + 1, vocab, generator=gen) * 2, dim=-1)  # [K+1, V]
        q = torch.softmax(torch.randn(K, vocab, generator=gen) * 2, dim=-1)  # [K, V]
        draft = torch.multinomial(q, 1, generator=gen).squeeze(1)  # [K]
        fast = speculative_verify(draft, q, p, torch.Generator().manual_seed(trial))
        slow = _speculative_reference(draft.tolist(), q, p, torch.Generator().manual_seed(trial))
        assert fast == slow


# Hand-built target p [K+1, V] and draft q [K, V] over V = 6 tokens.
P = torch.tensor([
    [0.30, 0.05, 0.25, 0.10, 0.20, 0.10],
    [0.05, 0.40, 0.05, 0.30, 0.10, 0.10],
    [0.10, 0.10, 0.10, 0.10, 0.10, 0.50],
    [0.60, 0.00, 0.10, 0.10, 0.10, 0.10],
])
Q = torch.tensor([
    [0.10, 0.40, 0.10, 0.10, 0.10, 0.20],
    [0.20, 0.20, 0.20, 0.20, 0.10, 0.10],
    [0.50, 0.10, 0.10, 0.10, 0.10, 0.10],
])


def _run_window(q: torch.Tensor, p: torch.Tensor, seed: int, trials: int):
    """``trials`` windows with drafts x_i ~ q_i; returns per-trial (drafts, num_accepted, next_token)."""
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(q, trials, replacement=True, generator=gen).T.contiguous()  # [trials, K]
    results = [speculative_verify(drafts[t], q, p, gen) for t in range(trials)]
    accepted = torch.tensor([n for n, _ in results])
    nexts = torch.tensor([tok for _, tok in results])
    return drafts, accepted, nexts


def test_rejection_path_emits_target_distribution():
    drafts, accepted, nexts = _run_window(Q, P, seed=1, trials=20000)
    vocab = P.shape[1]
    first = torch.where(accepted >= 1, drafts[:, 0], nexts)  # first emitted token of each window
    assert _tv(torch.bincount(first, minlength=vocab), P[0]) < 0.02
    # Acceptance of position 0 is sum_x min(p_0(x), q_0(x)) (= 0.65 here).
    assert abs(float((accepted >= 1).double().mean()) - float(torch.minimum(P[0], Q[0]).sum())) < 0.015
    assert (accepted == 0).any() and (accepted >= 2).any()  # both outcomes exercised
    # The token at position 1 (emitted when x_0 was accepted) follows p_1 as well.
    kept = accepted >= 1
    second = torch.where(accepted[kept] >= 2, drafts[kept, 1], nexts[kept])
    assert _tv(torch.bincount(second, minlength=vocab), P[1]) < 0.03


def test_bonus_path_when_draft_equals_target():
    K = Q.shape[0]
    _, accepted, nexts = _run_window(P[:K].clone(), P, seed=2, trials=10000)
    assert bool((accepted == K).all())  # p/q = 1 accepts every draft token
    assert _tv(torch.bincount(nexts, minlength=P.shape[1]), P[K]) < 0.02


def test_disjoint_draft_is_always_rejected_and_corrected_from_p():
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.0, 0.0, 0.5, 0.5]])
    gen = torch.Generator().manual_seed(3)
    counts = torch.zeros(4, dtype=torch.long)
    for _ in range(2000):
        x = torch.multinomial(q, 1, generator=gen).squeeze(1)
        n, tok = speculative_verify(x, q, p, gen)
        assert n == 0
        counts[tok] += 1
    assert counts[2:].sum() == 0 and _tv(counts, p[0]) < 0.04


def test_verify_window_applies_filtering_to_target():
    # top-k 1 makes p one-hot: the draft token 2 is rejected and the correction is the target's best.
    target_logits = torch.tensor([[0.0, 4.0, 3.9, 0.0], [1.0, 0.0, 0.0, 0.0]])
    q = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    params = SamplingParams(temperature=1.0, top_k=1)
    assert verify_window(torch.tensor([2]), q, target_logits, params, torch.Generator().manual_seed(0)) == (0, 1)
    # Draft 1 is accepted with certainty and the bonus is the one-hot argmax of row 1.
    q = torch.tensor([[0.0, 1.0, 0.0, 0.0]])
    assert verify_window(torch.tensor([1]), q, target_logits, params, torch.Generator().manual_seed(0)) == (1, 0)
    assert verify_window(torch.tensor([2]), None, target_logits, SamplingParams()) == (0, 1)
    with pytest.raises(ValueError):
        verify_window(torch.tensor([2]), None, target_logits, params)

