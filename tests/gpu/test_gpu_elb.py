"""ELB and verification on CUDA: same counts, plans and tokens as on the CPU."""

from __future__ import annotations

import pytest
import torch

from specter.predict.elb import ExpertLoadBuffer
from specter.speculative.sampling import greedy_verify, speculative_verify

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("num_experts,top_k,tokens", [(16, 2, 1), (60, 4, 9), (64, 6, 33)])
def test_elb_cuda_matches_cpu(num_experts, top_k, tokens):
    gen = torch.Generator().manual_seed(num_experts + tokens)
    layers = [1, 3, 4, 9]
    cpu = ExpertLoadBuffer(layers, num_experts, "cpu")
    gpu = ExpertLoadBuffer(layers, num_experts, "cuda")
    for _ in range(8):
        for layer in layers:
            scores = torch.rand(tokens, num_experts, generator=gen)  # [T, E]
            topk_idx = scores.topk(top_k, dim=-1).indices  # [T, k]
            cpu.add(layer, topk_idx)
            gpu.add(layer, topk_idx.cuda())
    assert torch.equal(gpu._cnt.cpu(), cpu._cnt.cpu())
    for m in (1, 4, 16, num_experts):
        capacity = {layer: m for layer in layers}
        assert gpu.snapshot_plan(capacity) == cpu.snapshot_plan(capacity)
    # Ties on the device also go to the lower expert id.
    gpu.clear()
    gpu.add(1, torch.tensor([[7, 2], [5, 2], [7, 5]], device="cuda"))
    assert gpu.snapshot_plan({1: 3, 3: 2}) == {1: [2, 5, 7], 3: []}


def test_verification_on_cuda():
    gen = torch.Generator().manual_seed(0)
    K, vocab = 8, 1000
    logits = torch.randn(K + 1, vocab, generator=gen)
    draft = logits[:K].argmax(-1)
    draft[5] = (draft[5] + 1) % vocab
    assert greedy_verify(draft.cuda(), logits.cuda()) == greedy_verify(draft, logits) == (5, int(logits[5].argmax()))
    # Stochastic: the first emitted token follows p_0 on the device too.
    p = torch.softmax(torch.randn(K + 1, 6, generator=gen), dim=-1).cuda()  # [K+1, V]
    q = torch.softmax(torch.randn(K, 6, generator=gen), dim=-1).cuda()  # [K, V]
    dev_gen = torch.Generator(device="cuda").manual_seed(1)
    counts = torch.zeros(6)
    for _ in range(4000):
        x = torch.multinomial(q, 1, generator=dev_gen).squeeze(1)  # [K]
        n, tok = speculative_verify(x, q, p, dev_gen)
        counts[int(x[0]) if n >= 1 else tok] += 1
    assert 0.5 * float((counts / counts.sum() - p[0].cpu()).abs().sum()) < 0.04
