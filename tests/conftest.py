"""Shared test fixtures: tiny checkpoints (built once into the cache) and config composition."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():  # before anything imports triton (gptqmodel does): its own jit helpers
        os.environ["TRITON_INTERPRET"] = "1"  # are interpreted too, or the interpreted draft kernel cannot call them
FIXTURES = REPO / "tests" / "fixtures"
TINY_MODELS = ("tiny_dsv2", "tiny_qwen", "tiny_phi")


def pytest_configure(config):
    import torch

    torch.set_num_threads(1)  # tiny models: one thread is fastest and immune to oversubscription


@pytest.fixture(scope="session")
def tiny_checkpoint():
    """name -> folder of the tiny checkpoint (built once into $SPECTER_HOME)."""
    from specter.models.tiny import ensure_tiny

    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = ensure_tiny(name)
        return cache[name]

    return get


def make_filled_store(E: int, layers=(1, 2), H: int = 8, I: int = 4):
    """A complete HostExpertStore whose every element names its expert (layer*1000 + e for gate_up,
    +0.5 for down), so a wrong slot shows in any byte."""
    import torch

    from specter.offload.store import ExpertLayout, ExpertUID, HostExpertStore

    store = HostExpertStore(ExpertLayout(H, I, torch.float32), list(layers), E, pin_memory=False)
    for layer in layers:
        for e in range(E):
            val = float(layer * 1000 + e)
            store.write(ExpertUID(layer, e), torch.full((2 * I, H), val), torch.full((H, I), val + 0.5))
    store.assert_complete()
    return store


@pytest.fixture
def filled_store():
    """The `make_filled_store` factory, as a fixture."""
    return make_filled_store


from specter.assembly.compose import compose  # noqa: E402,F401  (re-exported for tests)


def run_cli(args: list[str], cwd: Path | None = None, timeout: int = 600):
    """Run `python run.py args...` in a subprocess; returns CompletedProcess."""
    import subprocess

    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run(
        [sys.executable, str(REPO / "run.py"), *args],
        capture_output=True, text=True, cwd=cwd or REPO, env=env, timeout=timeout,
    )


def cli_in_process(args: list[str], capsys) -> tuple[int, str, str]:
    """`python run.py args` in-process: (exit status, stdout, stderr); the thread count is restored."""
    import torch

    from specter.experiments import cli as cli_mod

    threads = torch.get_num_threads()
    try:
        rc = cli_mod.main(args)
    finally:
        torch.set_num_threads(threads)
    out, err = capsys.readouterr()
    return rc, out, err


# a tiny served engine: 64-token context, rtn draft, fast emulated link (what the HTTP tests decode on)
SERVED_TINY = ["model=tiny_dsv2", "memory=low", "hardware=emulated", "hardware.bandwidth_gbps=20",
               "hardware.latency_us=5", "method=specter", "method.quant=rtn", "K=4", "model.context_length=64",
               "prefix_tokens=8", "max_new_tokens=16", "warmup_tokens=4"]


@pytest.fixture(scope="module")
def tiny_live_server():
    """A live `specter serve` of the tiny engine on loopback (specter.serve.server.ThreadedServer)."""
    pytest.importorskip("fastapi")
    from specter.api import build_served as load
    from specter.serve.server import ThreadedServer

    served = load(SERVED_TINY)
    try:
        with ThreadedServer(served, max_queue=8, drain_timeout_s=10) as srv:
            yield srv
    finally:
        served.close()
