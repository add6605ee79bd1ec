"""Draft kernel selection (`hardware.draft_kernel`), with the device's answers mocked by probes."""
from __future__ import annotations

import json

import pytest
import torch

from specter.kernels.select import AUTO_ORDER, KERNELS, KernelChoice, PROBES, select_draft_kernel


def probes(**unavailable: str):
    """Probes that answer like a machine where the named kernels are missing (reason given)."""
    calls: list[str] = []

    def make(name: str):
        def probe(device: torch.device, dtype: torch.dtype) -> str | None:
            calls.append(name)
            return unavailable.get(name)
        return probe

    return {name: make(name) for name in KERNELS}, calls


def test_auto_on_a_gpu_picks_triton_and_never_probes_marlin() -> None:
    p, calls = probes()
    choice = select_draft_kernel("auto", "cuda", torch.float16, probes=p)
    assert choice.selected == "triton" and calls == ["triton"]
    assert choice.as_dict() == {"requested": "auto", "selected": "triton", "device": "cuda", "unavailable": {}}


def test_auto_on_a_gpu_without_triton_falls_back_to_torch() -> None:
    p, calls = probes(triton="triton is not installed")
    choice = select_draft_kernel("auto", "cuda:0", torch.float16, probes=p)
    assert choice.selected == "torch" and "marlin" not in calls
    assert choice.as_dict()["unavailable"] == {"triton": "triton is not installed"}


def test_auto_on_a_cpu_is_torch_without_probing() -> None:
    p, calls = probes()
    assert select_draft_kernel("auto", "cpu", torch.float32, probes=p).selected == "torch"
    assert calls == []


@pytest.mark.parametrize("name", KERNELS)
def test_explicit_request_is_honoured_or_refused(name: str) -> None:
    p, calls = probes()
    assert select_draft_kernel(name, "cuda", torch.float16, probes=p).selected == name
    assert calls == [name]
    p, _ = probes(**{name: "not on this machine"})
    with pytest.raises(RuntimeError, match=f"draft_kernel={name} cannot run here: not on this machine"):
        select_draft_kernel(name, "cuda", torch.float16, probes=p)


def test_unknown_kernel_rejected() -> None:
    with pytest.raises(ValueError, match="unknown draft_kernel 'cutlass'"):
        select_draft_kernel("cutlass", "cuda", torch.float16)


def test_real_probes_on_this_cpu() -> None:
    """Here (no GPU) Triton and Marlin say why not; an explicit triton request on the CPU is refused."""
    cpu = torch.device("cpu")
    assert "CUDA" in PROBES["triton"](cpu, torch.float32)
    assert "CUDA" in PROBES["marlin"](cpu, torch.float16)
    assert PROBES["torch"](cpu, torch.float32) is None
    with pytest.raises(RuntimeError, match="draft_kernel=triton"):
        select_draft_kernel("triton", cpu, torch.float32)
    assert AUTO_ORDER[0] == "triton" and "marlin" not in AUTO_ORDER


def test_env_json_record_is_plain_json() -> None:
    p, _ = probes(triton="no triton")
    choice = select_draft_kernel("auto", "cuda", torch.float16, probes=p)
    assert isinstance(choice, KernelChoice)
    assert json.loads(json.dumps(choice.as_dict())) == {
        "requested": "auto", "selected": "torch", "device": "cuda", "unavailable": {"triton": "no triton"}}


def test_specter_on_cuda_selects_triton() -> None:
    """`method=specter hardware=cuda`: the composed config's draft_kernel and dtype, resolved on a
    (mocked) GPU with triton, select the Triton kernel; explicit overrides pass through."""
    from conftest import compose

    from specter.models.loading import DTYPES

    cfg = compose(["method=specter", "hardware=cuda"])
    requested = cfg.hardware.get("draft_kernel", "auto")
    dtype = DTYPES[cfg.hardware.dtype]
    p, _ = probes()
    assert select_draft_kernel(requested, cfg.hardware.device, dtype, probes=p).selected == "triton"
    for name in KERNELS:
        cfg = compose(["method=specter", "hardware=cuda", f"hardware.draft_kernel={name}"])
        assert select_draft_kernel(cfg.hardware.draft_kernel, cfg.hardware.device, dtype, probes=p).selected == name
