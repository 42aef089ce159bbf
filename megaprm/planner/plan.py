"""The plan of one config on N GPUs: memory by phase, the verdict, the knobs that would make it
fit, and time per phase; `search` ranks the layouts that fit by predicted step time."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megaprm.models.hf_spec import spec_from_hf
from megaprm.planner import experts, memory, timing
from megaprm.planner.hardware import DEFAULT_EFFICIENCY, GPU, Efficiency
from megaprm.planner.models import hf_config_for
from megaprm.planner.params import stage_params
from megaprm.planner.workload import Workload, workload_from_config

GB = 1e9


@dataclass
class ModelParams:
    role: str
    config: str           # where its config.json came from
    total: int
    per_gpu: int


@dataclass
class Plan:
    workload: Workload
    gpu: GPU
    models: list
    train: list           # [(term, bytes)]
    sync: list
    rollout: list
    seconds: dict
    knobs: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    @property
    def gpu_bytes(self) -> float:
        return self.gpu.mem_gb * GB

    @property
    def train_peak(self) -> float:
        return sum(b for _, b in self.train)

    @property
    def rollout_peak(self) -> float:
        return sum(b for _, b in self.rollout)

    @property
    def sync_peak(self) -> float:
        return sum(b for _, b in self.sync)

    @property
    def kv_tokens(self) -> float:
        return memory.kv_capacity_tokens(self.workload, self.gpu_bytes)

    def problems(self) -> list:
        """Why it does not fit ([] when it does)."""
        out = []
        cap = self.gpu_bytes
        if self.train_peak > cap:
            out.append(("train", self.train_peak, self.train))
        if self.sync_peak > cap:
            out.append(("weight sync", self.sync_peak, self.sync))
        if self.rollout_peak > cap:
            out.append(("rollout", self.rollout_peak, self.rollout))
        return out

    @property
    def kv_short(self) -> bool:
        w = self.workload
        return w.engine == "vllm" and self.kv_tokens < w.seq_len

    @property
    def fits(self) -> bool:
        return not self.problems() and not self.kv_short

    @property
    def step_seconds(self) -> float | None:
        """None when the rollout has no time (the KV cache holds no sequence)."""
        w = self.workload
        return timing.step_seconds(self.seconds, overlap=w.separate and w.max_staleness >= 1)

    def verdict(self) -> str:
        """One line: fits, or what does not fit, its largest terms and a knob."""
        mem = f"{self.gpu.mem_gb:g} GB"
        if self.fits:
            return (f"fits: train peak {self.train_peak / GB:.1f} GB, sync "
                    f"{self.sync_peak / GB:.1f} GB, rollout {self.rollout_peak / GB:.1f} GB of "
                    f"{mem} per GPU")
        if self.problems():
            phase, peak, terms = self.problems()[0]
            top = sorted(terms, key=lambda t: -t[1])[:3]
            what = ", ".join(f"{n} {b / GB:.1f} GB" for n, b in top)
            line = (f"does not fit: {phase} peak {peak / GB:.1f} GB > {mem} per GPU (largest: "
                    f"{what})")
        else:
            line = (f"does not fit: the engine's KV cache holds {self.kv_tokens:.0f} tokens, "
                    f"less than one sequence ({self.workload.seq_len})")
        if not self.knobs:
            return f"{line}; no single, pair or triple of overrides fits: more or larger GPUs"
        alt = f" (or {self.knobs[1]})" if len(self.knobs) > 1 else ""
        return f"{line}; try {self.knobs[0]}{alt}"


def _layout_params(w: Workload, exact: bool) -> memory.Params:
    a = stage_params(w.actor, w.tp, w.pp, exact, ep=w.ep)
    prm = stage_params(w.prm, w.tp, w.pp, exact) if w.prm is not None else None
    return memory.Params(actor_rank=a.per_rank, actor_total=a.total,
                         prm_rank=prm.per_rank if prm else 0, prm_total=prm.total if prm else 0,
                         actor_active=a.active)


def plan_workload(w: Workload, gpu: GPU, *, sources: dict | None = None,
                  eff: Efficiency = DEFAULT_EFFICIENCY, exact: bool = True,
                  knobs_of=None, with_knobs: bool = True) -> Plan:
    """`knobs_of`: the override keys this config has (e.g. whether actor.offload exists)."""
    p = _layout_params(w, exact)
    sources = sources or {}
    models = [ModelParams("actor", sources.get("actor", ""), p.actor_total, p.actor_rank)]
    if w.needs_ref:
        models.append(ModelParams("reference", sources.get("actor", ""), p.actor_total,
                                  p.actor_rank))
    if w.implicit:
        models.append(ModelParams("implicit PRM", sources.get("actor", ""), p.actor_total,
                                  p.actor_rank))
    if w.prm is not None:
        models.append(ModelParams("PRM", sources.get("prm", ""), p.prm_total, p.prm_rank))
    plan = Plan(w, gpu, models, memory.train_terms(w, p), memory.sync_terms(w, p),
                memory.rollout_terms(w, p, gpu.mem_gb * GB),
                timing.phase_seconds(w, p, gpu, eff))
    if w.actor.is_moe:
        plan.notes.append(experts.note(experts.expert_plan(
            w, gpu, stage_params(w.actor, w.tp, w.pp, exact, ep=w.ep)), w.ep))
    if w.judge:
        plan.notes.append("prm.kind=judge: the grader LLM's own engine is not planned")
    if w.separate:
        plan.notes.append(
            f"rollout.placement=separate: {w.trainer_world} trainer GPUs (train column; no "
            f"engine, so no sync phase) + {w.rollout_ranks} rollout GPUs (rollout column: "
            f"engines of tp {w.rollout_tp})" + (f"; max_staleness {w.max_staleness}: the step overlaps "
                                    "generation with training" if w.max_staleness else ""))
    if w.mean_response >= w.max_tokens:
        plan.notes.append("times assume every response runs to rollout.max_tokens (an upper "
                          "bound); --mean-response sets the expected length")
    host = memory.host_terms(w, p)
    if host:
        plan.notes.append("host memory per trainer rank: " + ", ".join(
            f"{n} {b / GB:.1f} GB" for n, b in host))
    if plan.seconds["rollout"] is None:
        plan.notes.append("rollout time: not applicable (the engine's KV cache holds no "
                          "whole sequence)")
    if with_knobs and not plan.fits:
        plan.knobs = knobs_that_fit(w, gpu, eff, exact, knobs_of or set())
    return plan


def candidate_knobs(w: Workload, keys: set) -> list:
    """(override text, changed workload) one at a time, cheapest first."""
    out = []
    if not w.recompute:
        out.append(("model.recompute=true", dataclasses.replace(w, recompute=True)))
    if not w.max_tokens_per_micro_batch:
        m = w.micro_batch_size // 2
        while m >= 1:
            out.append((f"actor.micro_batch_size={m}",
                        dataclasses.replace(w, micro_batch_size=m)))
            m //= 2
    for key, attr in (("actor.offload", "actor_offload"), ("ref.offload", "ref_offload"),
                      ("prm.offload", "prm_offload")):
        if key in keys and not getattr(w, attr):
            out.append((f"{key}=true", dataclasses.replace(w, **{attr: True})))
    for u in (0.4, 0.3, 0.2):
        if w.engine == "vllm" and u < w.gpu_memory_utilization:
            out.append((f"rollout.gpu_memory_utilization={u}",
                        dataclasses.replace(w, gpu_memory_utilization=u)))
    tp = w.tp * 2
    while tp * w.pp <= w.trainer_world and w.trainer_world % (tp * w.pp) == 0:
        try:
            w.actor.check_parallel(tp, w.pp)
            out.append((f"parallel.tp={tp}", dataclasses.replace(w, tp=tp)))
        except ValueError:
            pass
        tp *= 2
    if w.grad_reduce_in_fp32 and w.dtype_bytes == 2:
        out.append(("actor.optim.grad_reduce_in_fp32=false",
                    dataclasses.replace(w, grad_reduce_in_fp32=False)))
    return out


def knobs_that_fit(w: Workload, gpu: GPU, eff: Efficiency, exact: bool, keys: set) -> list:
    """Overrides that make it fit: single ones, else the pairs, else the triples, of different
    keys (fastest predicted step first)."""
    import itertools

    cands = candidate_knobs(w, keys)
    for k in (1, 2, 3):
        found = []
        for combo in itertools.combinations(cands, k):
            if len({text.split("=")[0] for text, _ in combo}) < k:
                continue
            x = w
            for text, changed in combo:  # apply each knob's change on top of the others
                x = dataclasses.replace(x, **{f.name: getattr(changed, f.name)
                                              for f in dataclasses.fields(w)
                                              if getattr(changed, f.name) != getattr(w, f.name)})
            p = plan_workload(x, gpu, eff=eff, exact=exact, with_knobs=False)
            if p.fits and p.step_seconds is not None:
                found.append((p.step_seconds, " ".join(text for text, _ in combo)))
        if found:
            return [text for _, text in sorted(found)[:3]]
    return []


def layouts(w: Workload) -> list:
    """(tp, pp) that divide the model and the GPUs."""
    out = []
    for tp in (1, 2, 4, 8):
        for pp in range(1, w.actor.num_layers + 1):
            if w.trainer_world % (tp * pp) or tp * pp > w.trainer_world:
                continue
            try:
                w.actor.check_parallel(tp, pp)
                if w.prm is not None:
                    w.prm.check_parallel(tp, pp)
            except ValueError:
                continue
            if (w.prompts % (w.trainer_world // (tp * pp))) == 0:
                out.append((tp, pp))
    return out


def search(w: Workload, gpu: GPU, eff: Efficiency = DEFAULT_EFFICIENCY,
           exact: bool = True) -> list:
    """Plans of the layouts that fit, fastest first (recompute tried where needed)."""
    found = []
    for tp, pp in layouts(w):
        for recompute in sorted({w.recompute, True}):
            x = dataclasses.replace(w, tp=tp, pp=pp, recompute=recompute)
            p = plan_workload(x, gpu, eff=eff, exact=exact, with_knobs=False)
            if p.fits and p.step_seconds is not None:
                found.append(p)
                break
    return sorted(found, key=lambda p: p.step_seconds)


# ------------------------------------------------------------------------------- rendering

def _gb(b: float) -> str:
    return f"{b / GB:6.1f}"


def _count(n: int) -> str:
    return f"{n / 1e9:.3f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def table(plan: Plan) -> str:
    w = plan.workload
    where = (f" ({w.trainer_world} trainer + {w.rollout_ranks} rollout)" if w.separate
             else "")
    head = (f"megaprm plan: {w.world}{where} x {plan.gpu.name.upper()} ({plan.gpu.mem_gb:g} GB), "
            f"tp={w.tp} pp={w.pp} dp={w.dp}, {'bf16' if w.dtype_bytes == 2 else 'fp32'}, "
            f"{w.samples} rollouts of <= {w.seq_len} tokens, micro-batch "
            f"{w.micro_tokens} tokens, recompute {'on' if w.recompute else 'off'}")
    lines = [head,
             "", f"{'model':<14}{'params':>12}{'per GPU':>12}  config"]
    for m in plan.models:
        lines.append(f"{m.role:<14}{_count(m.total):>12}{_count(m.per_gpu):>12}  {m.config}")
    lines += ["", f"{'memory per GPU (GB)':<42}{'train':>8}{'sync':>8}{'rollout':>9}"]
    phases = (plan.train, plan.sync, plan.rollout)
    names = list(dict.fromkeys(n for terms in phases for n, _ in terms))
    cols = [dict(t) for t in phases]
    for n in names:
        cells = [_gb(c[n]) if n in c else "     -" for c in cols]
        lines.append(f"  {n:<40}{cells[0]:>8}{cells[1]:>8}{cells[2]:>9}")
    lines.append(f"  {'peak':<40}{_gb(plan.train_peak):>8}{_gb(plan.sync_peak):>8}"
                 f"{_gb(plan.rollout_peak):>9}")
    if w.engine == "vllm":
        lines.append(f"  KV cache: {memory.kv_bytes_per_token(w) / 1024:.0f} KiB/token per GPU, "
                     f"room for {plan.kv_tokens:,.0f} tokens = {plan.seconds['_concurrent']} "
                     f"concurrent sequences of {memory.engine_sequences(w)} per engine")
    lines += ["", "time per step (s)"]
    for k, v in plan.seconds.items():
        if not k.startswith("_"):
            lines.append(f"  {k:<40}" + ("  not applicable" if v is None else f"{v:8.1f}"))
    step = plan.step_seconds
    lines.append(f"  {'step':<40}" + ("  not applicable" if step is None else f"{step:8.1f}"))
    lines += ["", plan.verdict()]
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def to_json(plan: Plan) -> dict:
    w = plan.workload
    return {
        "gpu": dataclasses.asdict(plan.gpu), "gpus": w.world,
        "layout": {"tp": w.tp, "pp": w.pp, "dp": w.dp, "recompute": w.recompute},
        "placement": {"separate": w.separate, "trainer_gpus": w.trainer_world,
                      "rollout_gpus": w.rollout_ranks, "max_staleness": w.max_staleness},
        "models": [dataclasses.asdict(m) for m in plan.models],
        "memory_bytes": {"train": dict(plan.train), "sync": dict(plan.sync),
                         "rollout": dict(plan.rollout), "train_peak": plan.train_peak,
                         "sync_peak": plan.sync_peak, "rollout_peak": plan.rollout_peak},
        "kv_cache": {"bytes_per_token": memory.kv_bytes_per_token(w),
                     "capacity_tokens": plan.kv_tokens,
                     "concurrent_sequences": plan.seconds["_concurrent"],
                     "sequences_per_engine": memory.engine_sequences(w)},
        "seconds": {k: v for k, v in plan.seconds.items() if not k.startswith("_")},
        "step_seconds": plan.step_seconds,
        "fits": plan.fits, "verdict": plan.verdict(), "knobs": plan.knobs, "notes": plan.notes,
    }


def search_table(plans: list) -> str:
    if not plans:
        return "no layout fits"
    lines = [f"{'tp':>3}{'pp':>4}{'dp':>4}  recompute{'train GB':>10}{'rollout GB':>12}"
             + f"{'step s':>9}"]
    for p in plans:
        w = p.workload
        lines.append(f"{w.tp:>3}{w.pp:>4}{w.dp:>4}  {'on ' if w.recompute else 'off':<9}"
                     f"{p.train_peak / GB:>10.1f}{p.rollout_peak / GB:>12.1f}"
                     f"{p.step_seconds:>9.1f}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------- from a config

def workload_of(cfg, raw: dict, world: int, *, prompt_tokens=None, mean_response=None,
                max_response=None):
    """(Workload, {role: config.json source}) of a validated config on `world` GPUs: the HF
    config.json of model.path (and a discriminative prm.path), else the shipped copy."""
    # deferred: megatron
    from megaprm.models.prm import PRM_HEADS, as_prm_spec

    a = hf_config_for(cfg.model.path, "model.path")
    actor = spec_from_hf(a.config)
    sources, prm = {"actor": a.where}, None
    if cfg.prm.kind == "discriminative":
        s = hf_config_for(cfg.prm.path, "prm.path")
        prm = spec_from_hf(s.config)
        if prm.head not in PRM_HEADS:  # an LM directory turned into a PRM by megaprm
            prm = as_prm_spec(prm, "token_cls")
        sources["prm"] = s.where
    w = workload_from_config(cfg, raw, world=world, actor=actor, prm=prm,
                             prompt_tokens=prompt_tokens, mean_response=mean_response)
    if max_response:
        w = dataclasses.replace(w, max_response=min(float(max_response), w.max_tokens))
    if w.trainer_world < 1:
        raise ValueError(f"--gpus {world} leaves no trainer GPU beside rollout.ranks="
                         f"{w.rollout_ranks}")
    if w.trainer_world % (w.tp * w.pp):
        what = (f"--gpus {world} - rollout.ranks {w.rollout_ranks} = {w.trainer_world} trainer "
                "GPUs" if w.separate else f"--gpus {world}")
        raise ValueError(f"{what} is not a multiple of tp x pp = {w.tp * w.pp}")
    actor.check_parallel(w.tp, w.pp)
    return w, sources


def override_keys(cfg) -> set:
    """The offload switches this config has (actor/ref/prm.offload)."""
    keys = set()
    for section in ("actor", "ref", "prm"):
        if hasattr(getattr(cfg, section, None), "offload"):
            keys.add(f"{section}.offload")
    return keys
