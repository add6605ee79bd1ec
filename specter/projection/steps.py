"""The projection's engine steps on one model x tier: the methods' rows, the K profiles, batching, the α curve.

Each step builds methods with the harness's builder on the tiny proxy at the real model's slots
(`Proxy.config`) and runs them on the virtual clock (`engine_run`). Prompts are the starts of held-out
documents: the measured ones first (0 .. project.prompts - 1), then the K profile's, so a K is never
chosen on the prompts it is reported with; batching takes the first B of its own list.
"""

from __future__ import annotations

from omegaconf import DictConfig

from specter.assembly.config import ConfigError
from specter.assembly.runners import method_facts, method_names

# Which methods each step takes, from the registry's facts (specter/assembly/runners.py): the projected ones
# (in-process, built by `build_method`), the profilable ones (their design tunes K: SpecMoEOff's optimizer tunes its
# draft length) and the batched ones (a batched loop on the virtual clock).


def int_list(value, key: str, least: int = 1) -> list[int]:
    values = list(value)
    if not values or any(not isinstance(v, int) or isinstance(v, bool) or v < least for v in values):
        raise ConfigError(f"{key} must be a non-empty list of integers >= {least}, got {values}")
    return sorted(set(values))


def check_project(cfg: DictConfig) -> None:
    """Every project.* key the engine steps read, checked before any model loads."""
    from specter.projection.drafts import parse_draft

    p = cfg.project
    projected = method_names(projected=True)
    unknown = [m for m in p.methods if m not in projected]
    if unknown:
        raise ConfigError(f"project.methods: {unknown} are not in-process methods; choose from {list(projected)}")
    if str(p.quant) not in ("rtn", "gptq"):
        raise ConfigError(f"project.quant={p.quant!r} is not gptq (the paper's draft) or rtn")
    if int(p.prompts) < 1 or int(p.new_tokens) < 2:
        raise ConfigError("project.prompts must be >= 1 and project.new_tokens >= 2")
    profilable, batched = method_names(projected=True, tunes_k=True), method_names(batched_projection=True)
    for key, allowed in (("profile", profilable), ("batch_methods", batched), ("alpha_methods", batched)):
        bad = [m for m in p[key] if m not in allowed]
        if bad:
            raise ConfigError(f"project.{key}: {bad} not one of {list(allowed)}")
    int_list(p.k_values, "project.k_values")
    int_list(p.batch_sizes, "project.batch_sizes")
    if int(p.profile_prompts) < 1 or int(p.batch_new_tokens) < 2:
        raise ConfigError("project.profile_prompts must be >= 1 and project.batch_new_tokens >= 2")
    for text in p.alpha_drafts:
        try:
            parse_draft(text)
        except ValueError as err:
            raise ConfigError(f"project.alpha_drafts: {err}") from None


def draft_name(quant: str, bits: int = 4) -> str:
    """The draft every speculative row is charged as: the paper's GPTQ INT4 g128, or its RTN counterpart;
    a proxy whose GPTQ precision is calibrated (`model.draft_bits`) is named with the bits its acceptance comes from."""
    from specter.projection.drafts import DraftSpec

    name = DraftSpec(quant, 4, 128).name
    return name if bits == 4 or quant != "gptq" else f"{name} (acceptance: the proxy's {bits}-bit calibration)"


class Proxy:
    """The proxy's composed configs and prompts, shared by every engine step of one projection."""

    def __init__(self, cfg: DictConfig, proxy: str, slots: dict, K: int, real: str):
        from specter.models.tiny import tiny_dir

        self.cfg, self.proxy, self.slots, self.K, self.real = cfg, proxy, slots, K, real
        self.trained = (tiny_dir(proxy, trained=True) / "config.json").is_file()
        self.name = tiny_dir(proxy, trained=self.trained).name
        self._checkpoint = None
        self._proxy_layers: int | None = None
        self._prompts: dict[int, list] = {}

    def config(self, method: str, K: int | None = None, quant: str | None = None) -> DictConfig:
        """`method` on the proxy at the real model's slots; K: a draft length other than the method's default."""
        from specter.assembly.compose import compose
        from specter.projection.engine_run import proxy_overrides

        p = self.cfg.project
        over = proxy_overrides(self.proxy, self.trained, str(self.cfg.memory.name), method, self.proxy_slots(method),
                               self.K if K is None else K, str(quant or p.quant), int(self.cfg.seed))
        if K is not None and not any(o.startswith("K=") for o in over):
            over.append(f"K={K}")  # a method whose default K is its own (SpecMoEOff)
        return compose([*over, f"prefix_tokens={int(self.cfg.prefix_tokens)}"])

    def proxy_slots(self, method: str) -> tuple[int | None, int]:
        """`method`'s slots on the proxy: the real plan's M per layer, and its staging buffers scaled from the real
        model's MoE layers to the proxy's (each proxy layer stands for a block of real layers, and its loads are
        counted once per real layer: one proxy buffer holds a whole block's worth of experts). As a CPU run sizes
        them from the same plan (`assembly.real_plan.PlannedSlots.staging`)."""
        M, S = self.slots[method]
        if not method_facts(method).owns_cache:  # every expert on the device: no slots to scale
            return M, S
        from specter.assembly.real_plan import PlannedSlots

        return M, PlannedSlots(M, S / self.real_moe_layers, "the real plan").staging(self.proxy_moe_layers)

    @property
    def real_moe_layers(self) -> int:
        from specter.projection.cost_model import real_shape

        return real_shape(self.real).moe_layers

    @property
    def proxy_moe_layers(self) -> int:
        import torch

        from specter.models.footprint import load_config, model_facts

        if self._proxy_layers is None:
            self._proxy_layers = model_facts(load_config(self.checkpoint), torch.float32).moe_layers
        return self._proxy_layers

    @property
    def draft_bits(self) -> int:
        """The proxy's GPTQ draft precision (its acceptance calibration, `model.draft_bits`)."""
        return int(self.config("specter").model.get("draft_bits") or 4)

    @property
    def checkpoint(self):
        from specter.assembly.runtime import model_checkpoint

        if self._checkpoint is None:
            self._checkpoint = model_checkpoint(self.config("target_only"))
        return self._checkpoint

    def prompts(self, first: int, count: int) -> list:
        """Held-out prompts first .. first + count - 1."""
        from specter.projection.engine_run import held_out_prompts

        n = first + count
        if max(self._prompts, default=0) < n:
            self._prompts = {n: held_out_prompts(self.checkpoint, n, int(self.cfg.prefix_tokens))}
        return self._prompts[max(self._prompts)][first:n]

    def measure(self, cm, method: str, K: int | None = None, prompts: list | None = None, prepare=None):
        """`method` projected on the measured prompts (or `prompts`)."""
        from specter.projection.engine_run import run_method

        p = self.cfg.project
        prompts = prompts if prompts is not None else self.prompts(0, int(p.prompts))
        return run_method(self.config(method, K), self.checkpoint, cm, prompts, int(p.new_tokens),
                          int(p.warmup_tokens), self.slots[method], int(p.timeline_window), prepare=prepare)


def k_values(px: Proxy, method: str) -> list[int]:
    """The K set a method's profile sweeps: project.k_values for Specter (the paper's sweep), SpecMoEOff's own
    method.k_range (its design's search range)."""
    if method_facts(method).own_k_profile:
        return int_list(px.config(method).method.k_range, "method.k_range")
    return int_list(px.cfg.project.k_values, "project.k_values")


def profiles(px: Proxy, cm, methods: list[str]) -> dict:
    """Per method, its K profile on the modelled device, on the profile prompts: one build, one engine per K."""
    from specter.projection.engine_run import close, measure, open_method, set_K
    from specter.projection.profile import profile

    p = px.cfg.project
    held = px.prompts(int(p.prompts), int(p.profile_prompts))
    out = {}
    for name in methods:
        print(f"  {name}: K profile on {cm.d.name} ({len(held)} profile prompts x {int(p.new_tokens)} tokens)",
              flush=True)
        session = open_method(px.config(name), px.checkpoint, cm)
        try:
            def run(K: int, name=name, session=session):
                set_K(session, K)
                return measure(session, name, int(px.cfg.seed), held, int(p.new_tokens), int(p.warmup_tokens))
            out[name] = profile(name, k_values(px, name), run)
        finally:
            close(session)
        print(f"  {name}: profiled K = {out[name].best}", flush=True)
    return out


def k_variants(name: str, profiled: dict) -> list[tuple[str, int | None]]:
    """(k_source, K) per row of a method. K None is the method's default: the paper's K for Specter and MoE-Spec,
    the paper artifact's K = 3 for SpecMoEOff. A profiled method's profiled row comes first; MoE-Spec reads
    Specter's profile, as on the CPU."""
    facts = method_facts(name)
    if facts.reads_specter_profile and not facts.tunes_k:  # MoE-Spec: Specter's K
        return [("profiled", profiled["specter"].best)] if "specter" in profiled else [("paper", None)]
    if name in profiled:
        return [("profiled", profiled[name].best), ("paper", None)]
    return [("paper", None)]


def engine_runs(px: Proxy, cm) -> tuple[list[tuple[str, str, object]], dict]:
    """(method, k_source, Projected) per row, and the profiles."""
    p = px.cfg.project
    methods = list(p.methods)
    profilable = method_names(projected=True, tunes_k=True)
    profiled = profiles(px, cm, [m for m in profilable if m in methods and m in p.profile])
    out = []
    for name in methods:
        for source, k in k_variants(name, profiled):
            r = px.measure(cm, name, k)
            tpot = "-" if r.tpot is None else f"{r.tpot * 1e3:.2f}"
            print(f"  {name}{'' if r.K is None else f' (K={r.K}, {source})'}: {tpot} ms/token projected", flush=True)
            M, S = px.proxy_slots(name)
            if method_facts(name).owns_cache and (r.resident, r.staging) != (M, S):
                raise RuntimeError(f"{name}: the proxy ran with M={r.resident} + {r.staging} staging buffers, the "
                                   f"real model's plan scaled to the proxy says M={M} + {S}")
            out.append((name, source if r.K is not None else "", r))
    return out, profiled


def batch_step(px: Proxy, cm, base: dict[str, str]) -> list[dict[str, str]]:
    """project.batch_methods at B = project.batch_sizes, each at its default K (the paper's setup)."""
    from specter.projection.batching import batch_rows, prepare_batching, run_batches
    from specter.projection.engine_run import close, open_method

    p = px.cfg.project
    sizes = int_list(p.batch_sizes, "project.batch_sizes")
    prompts = px.prompts(0, max(sizes))
    rows = []
    for name in p.batch_methods:
        print(f"  {name}: batched, B = {sizes}, {int(p.batch_new_tokens)} new tokens per request", flush=True)
        session = open_method(px.config(name), px.checkpoint, cm, prepare=prepare_batching)
        try:
            points = run_batches(session, int(px.cfg.seed), prompts, sizes, int(p.batch_new_tokens),
                                 int(p.warmup_tokens))
        finally:
            close(session)
        rows += batch_rows(name, points, base)
    return rows


def alpha_step(px: Proxy, cm, base: dict[str, str]) -> list[dict[str, str]]:
    """project.alpha_methods with every draft of project.alpha_drafts, each at its default K, measured prompts."""
    from specter.projection.alpha import alpha_rows
    from specter.projection.drafts import install_draft, parse_draft

    p = px.cfg.project
    drafts = [parse_draft(t) for t in p.alpha_drafts]
    rows = []
    for name in p.alpha_methods:
        print(f"  {name}: alpha curve over {len(drafts)} drafts", flush=True)
        rows += alpha_rows(name, drafts, lambda spec, name=name: px.measure(
            cm, name, prepare=lambda method, spec=spec: install_draft(method, spec)), base)
    return rows
