"""Roofline cost of the engine's operations at a real model's sizes on a modelled device.

Per operation: the weight bytes it reads and the FLOPs it does, from the real model's config.json
(`specter/models/real_configs/`), at FP16 (2 bytes) unless INT4. Time =
``max(bytes / (HBM bandwidth x efficiency), flops / peak) + launches x launch overhead``.
An H2D copy costs ``latency + bytes / H2D bandwidth``.

Counted: the weight matrices of every linear map (biases and norm weights are < 0.1 % and left
out, except the norms' vectors which are counted), activations are not (decode reads weights, a
few KB of activations). Attention's KV reads are left out: the paper's protocol keeps the context
under 200 tokens, a few MB at most against hundreds of MB of weights.
Launch counts are the eager path's (one kernel per matmul / activation / norm); the fused INT4
draft kernel runs one launch for all of a layer's routed experts.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from specter.config_error import ConfigError  # torch-free and harness-free, as this module is

DEVICES = Path(__file__).resolve().parent / "devices"
FP16 = 2
INT4_GROUP = 128  # GPTQ group size: one FP16 scale per 128 weights (specter/quant)

# Eager kernel launches per operation (why: each matmul, activation and norm is its own kernel).
LAUNCHES = {"attention": 12, "router": 3, "expert": 4, "shared": 5, "lm_head": 2, "draft_fused": 1}


@dataclass(frozen=True)
class Device:
    name: str
    hbm_bandwidth: float
    hbm_efficiency: float
    peak_fp16: float
    peak_int4_effective: float
    launch_overhead: float
    h2d_bandwidth: float
    h2d_latency: float
    d2h_bandwidth: float
    d2h_latency: float
    sources: dict

    @property
    def bw(self) -> float:
        return self.hbm_bandwidth * self.hbm_efficiency

    def replace(self, **values: float) -> "Device":
        from dataclasses import replace

        return replace(self, **values)


class UnknownDevice(ConfigError, FileNotFoundError):
    """No such device file: a user error (one line), and the FileNotFoundError callers catch."""


def load_device(name_or_path: str | Path) -> Device:
    """A device file (`devices/<name>.yaml` or a path); every parameter is {value, source}.

    Refused in one line (ConfigError), so no projection is ever computed from it: a file that is
    missing, unreadable or not a YAML mapping; a missing parameter; a value that is not a finite
    positive number (an efficiency above 1); a parameter without a source."""
    path = Path(name_or_path)
    if not path.suffix:
        path = DEVICES / f"{name_or_path}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in DEVICES.glob("*.yaml"))
        raise UnknownDevice(f"no device file {path}; known devices: {known}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"device file {path} cannot be read ({getattr(err, 'strerror', None) or err})") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"device file {path} is not valid YAML: {' '.join(str(err).split())}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"device file {path} must be a mapping of parameters, got {type(data).__name__}")
    fields = [f for f in Device.__dataclass_fields__ if f not in ("name", "sources")]
    missing = [f for f in fields if f not in data]
    if missing:
        raise ConfigError(f"device file {path}: missing {missing}")
    values, sources = {}, {}
    for f in fields:
        entry = data[f]
        if not isinstance(entry, dict) or "value" not in entry:
            raise ConfigError(f"device file {path}: {f} must be {{value: <number>, source: <text>}}, got {entry!r}")
        value, source = entry["value"], entry.get("source")
        number = _number(value)
        upper = 1.0 if f == "hbm_efficiency" else math.inf
        if number is None or not (0 < number <= upper):
            bound = "in (0, 1]" if f == "hbm_efficiency" else "a finite number > 0"
            raise ConfigError(f"device file {path}: {f} must be {bound}, got {value!r}")
        if not isinstance(source, str) or not source.strip():
            raise ConfigError(f"device file {path}: {f} has no source (say where its value comes from)")
        values[f], sources[f] = number, source
    name = data.get("name", path.stem)
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"device file {path}: name must be text, got {name!r}")
    return Device(name=name, sources=sources, **values)


def _number(value: object) -> float | None:
    """A finite float of a YAML value (PyYAML reads `1e12` without a dot as text), else None."""
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


@dataclass(frozen=True)
class Op:
    """One operation: weight bytes read, FLOPs, kernel launches."""

    name: str
    bytes: float
    flops: float
    launches: int

    def time(self, dev: Device, peak: float | None = None) -> float:
        return max(self.bytes / dev.bw, self.flops / (peak or dev.peak_fp16)) + self.launches * dev.launch_overhead


@dataclass(frozen=True)
class RealShape:
    """The sizes of a real model that its operations' costs depend on."""

    model_type: str
    hidden: int
    expert_inter: int
    num_experts: int
    top_k: int
    num_layers: int
    moe_layers: int
    vocab: int
    attn_params: int  # weights of one layer's attention (all projections)
    shared_params: int  # weights of one layer's shared experts (+ the shared gate); 0 when none
    dense_mlp_params: int = 0  # weights of a dense (non-MoE) layer's MLP (DeepSeek-V2's layer 0)


def real_shape(name: str) -> RealShape:
    """Sizes from the shipped config.json of `dsv2`, `qwen15moe` or `phi35moe`."""
    from specter.models.footprint import real_config_path

    c = json.loads(real_config_path(name).read_text())
    H, mt, heads = c["hidden_size"], c["model_type"], c["num_attention_heads"]
    if mt == "deepseek_v2":
        nope, rope, v, r = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
        q = H * c["q_lora_rank"] + c["q_lora_rank"] * heads * (nope + rope) if c.get("q_lora_rank") else H * heads * (nope + rope)
        attn = q + H * (r + rope) + r * heads * (nope + v) + heads * v * H
        E, I = c["n_routed_experts"], c["moe_intermediate_size"]
        shared = 3 * H * I * c["n_shared_experts"]
        moe = c["num_hidden_layers"] - c["first_k_dense_replace"]
        dense = 3 * H * c["intermediate_size"]
    else:
        hd, kv = H // heads, c["num_key_value_heads"]
        attn = 2 * H * heads * hd + 2 * H * kv * hd
        if mt == "qwen2_moe":
            E, I = c["num_experts"], c["moe_intermediate_size"]
            shared = 3 * H * c["shared_expert_intermediate_size"] + H
        else:
            E, I, shared = c["num_local_experts"], c["intermediate_size"], 0
        moe, dense = c["num_hidden_layers"], 0
    return RealShape(mt, H, I, E, c["num_experts_per_tok"], c["num_hidden_layers"], moe, c["vocab_size"], attn, shared,
                     dense)


class CostModel:
    """Per-operation costs of one real model on one device."""

    def __init__(self, shape: RealShape, device: Device):
        self.s, self.d = shape, device

    # -- operations (n = tokens in the forward: 1 for a decode step, K+1 for a verification)
    def attention(self, n: int = 1) -> Op:
        s = self.s
        return Op("attention+norms", s.attn_params * FP16 + 2 * s.hidden * FP16, 2 * s.attn_params * n,
                  LAUNCHES["attention"])

    def router(self, n: int = 1) -> Op:
        p = self.s.hidden * self.s.num_experts
        return Op("router", p * FP16, 2 * p * n, LAUNCHES["router"])

    def shared(self, n: int = 1) -> Op:
        p = self.s.shared_params
        return Op("shared", p * FP16, 2 * p * n, LAUNCHES["shared"] if p else 0)

    def dense_mlp(self, n: int = 1) -> Op:
        p = self.s.dense_mlp_params
        return Op("dense_mlp", p * FP16, 2 * p * n, LAUNCHES["shared"] if p else 0)

    def dense_only_layer(self, n: int = 1) -> float:
        """One dense (non-MoE) decoder layer: attention + norms and its MLP."""
        return self.t(self.attention(n)) + self.t(self.dense_mlp(n))

    def expert_params(self) -> int:
        return 3 * self.s.hidden * self.s.expert_inter

    def expert(self, n: int = 1) -> Op:
        """One routed FP16 expert on the `n` tokens routed to it."""
        p = self.expert_params()
        return Op("expert", p * FP16, 2 * p * n, LAUNCHES["expert"])

    def int4_expert_bytes(self) -> float:
        p = self.expert_params()
        return p / 2 + p / INT4_GROUP * FP16  # packed nibbles + one FP16 scale per group

    def draft_experts(self, k: int, fused: bool = True, routes: int | None = None) -> Op:
        """A draft step's `k` distinct INT4 routed experts of one layer over `routes` (token, expert) pairs
        (default k: one token): fused = one launch."""
        p = self.expert_params()
        launches = LAUNCHES["draft_fused"] if fused else k * LAUNCHES["expert"]
        return Op("draft_experts", k * self.int4_expert_bytes(), 2 * p * (k if routes is None else routes), launches)

    def lm_head(self, n: int = 1) -> Op:
        p = self.s.vocab * self.s.hidden
        return Op("lm_head", p * FP16, 2 * p * n, LAUNCHES["lm_head"])

    def expert_bytes(self) -> int:
        return self.expert_params() * FP16

    # -- times
    def t(self, op: Op, int4: bool = False) -> float:
        return op.time(self.d, self.d.peak_int4_effective if int4 else None)

    def h2d(self, nbytes: float | None = None) -> float:
        nbytes = self.expert_bytes() if nbytes is None else nbytes
        return self.d.h2d_latency + nbytes / self.d.h2d_bandwidth

    def dense_layer(self, n: int = 1) -> float:
        """One MoE layer's non-routed work: attention + norms, router, shared experts."""
        return self.t(self.attention(n)) + self.t(self.router(n)) + self.t(self.shared(n))

    def draft_step(self, fused: bool = True) -> float:
        """One draft token through every layer: FP16 non-expert work, INT4 routed experts, lm_head."""
        s = self.s
        per = self.dense_layer(1) + self.t(self.draft_experts(s.top_k, fused), int4=True)
        return (s.num_layers - s.moe_layers) * self.dense_only_layer(1) + s.moe_layers * per + self.t(self.lm_head(1))

    def target_step_resident(self) -> float:
        """One target decode token with every expert on the device (target_only)."""
        s = self.s
        return ((s.num_layers - s.moe_layers) * self.dense_only_layer(1)
                + s.moe_layers * (self.dense_layer(1) + s.top_k * self.t(self.expert(1))) + self.t(self.lm_head(1)))


def cost_model(model: str, device: str | Device) -> CostModel:
    return CostModel(real_shape(model), device if isinstance(device, Device) else load_device(device))


SWEEP = {"h2d_bandwidth": (0.5, 1.0, 2.0), "launch_overhead": (0.5, 1.0, 2.0), "hbm_bandwidth": (0.5, 1.0, 2.0)}


def sensitivity(model: str, device: str, metric) -> list[tuple[str, float, float]]:
    """`metric(CostModel)` at each parameter of SWEEP scaled by each factor: (parameter, factor, value)."""
    base = load_device(device)
    out = []
    for param, factors in SWEEP.items():
        for f in factors:
            dev = base.replace(**{param: getattr(base, param) * f})
            out.append((param, f, metric(CostModel(real_shape(model), dev))))
    return out
