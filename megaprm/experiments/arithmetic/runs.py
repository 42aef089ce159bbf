"""The design every arithmetic run shares: the task, the RL settings, the methods and their own
knobs, and what one run of the comparison is (`RunSpec` -> `run_overrides`). The demo's runs are
the comparison's runs of one seed, built by the same `run_overrides`.

Light on purpose: the CLI's parser imports this module (`ALL_METHODS`, `CompareConfig`), so it
pulls in neither torch nor the trainer.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from megaprm.tasks.arithmetic import TASKS, ArithmeticConfig, generate_problems

# the tasks of the comparison: tasks.arithmetic.TASKS ("short", "long"), named there
TASK = TASKS["short"]
# rollout.max_tokens per task: the longest reference solution (+ EOS) with room to spare
# (short: 37 tokens; long: 208)
MAX_TOKENS = {"short": 64, "long": 224}
# the start's recipe where a task's differs from CompareConfig's defaults (the long task: a
# longer warm-up for its chains; a PRM of 1000 whole-model steps, as its solutions are ~5x
# longer than the short task's, fine-tuned from the start's warm-up policy as the field's PRMs
# are from their policy or base model: from a random-init trunk the same 1000 steps left it at
# held-out step AUROC 0.653 and first-error F1 0.389, finding no wrong result or operand;
# from the warm-up 0.907 and 0.873, docs/prm.md)
TASK_DEFAULTS = {"long": {"warmup_steps": 600, "prm_steps": 1000, "prm_init": "warmup"}}
# where a start's PRM trunk comes from: "random" (a random-init qwen2 of prm_hidden x
# prm_layers, the short task's and the shipped demo's) or "warmup" (the start's warm-up policy:
# its trunk and LM head, a fresh score head)
PRM_INITS = ("random", "warmup")
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the checkout holding the package (docs/ lives there; a wheel has none)
REPO_ROOT = os.path.dirname(PACKAGE_DIR)
# the RL settings every demo / compare run starts from (model, PRM, run dir come as overrides)
RL_YAML = os.path.join(PACKAGE_DIR, "configs", "demo.yaml")

# labelled variants: (the method, overrides on top of its own). `prime_scaled`: PRIME with the
# implicit PRM's beta scaled from the released 0.05 (responses of ~600+ tokens) to ~32-token
# responses; `prime_scaled_lr`: the same beta with a 10x smaller PRM learning rate, so that the
# outcome logit moves about as fast per update as with the released pair (docs/compare.md,
# "PRIME at this response length")
VARIANTS = {"prime_scaled": ("prime", ["prm.beta=1.0"]),
            "prime_scaled_lr": ("prime", ["prm.beta=1.0", "prm.optim.lr=1e-5"])}


ALL_METHODS = ("grpo", "rloo", "prof_grpo", "papo", "pure", "prime", "prime_scaled",
               "prime_scaled_lr", "blend")


REFERENCE = "grpo"  # the paired differences are taken from this method's run of the same seed


# methods whose advantages read the discriminative/oracle step scores (the others ignore them:
# their oracle row would be the same run, so it is not re-run)
READS_STEP_SCORES = ("prof_grpo", "papo", "pure", "blend")

# Each method's own knobs on the demo task; the actor, batch and schedule (configs/demo.yaml)
# are shared, so methods differ only in their rewards and estimator. PRIME: the implicit PRM
# starts from the policy with twice the actor's lr (released: PRM 1e-6 / actor 5e-7,
# configs/prime.yaml), refilling the accuracy-filtered batch (ray_trainer.py, cap 4 as
# configs/prime_tiny.yaml). PURE: the released PRM's step reward is 2p - 1 (token-classification
# head), the megaprm PRM gives p.
METHOD_OVERRIDES = {
    "prime": ["prm.kind=implicit", "prm.path=null", "prm.optim.lr=1e-4",
              "rollout.refill=accuracy", "rollout.max_refill_rounds=4"],
    "pure": ["advantage.pure.step_scores_are_probs=true"],
}


def base_method(name: str) -> str:
    """The registry method a (possibly variant) row name runs."""
    return VARIANTS[name][0] if name in VARIANTS else name


@dataclass
class CompareConfig:
    run_dir: str = "runs/compare"
    task: str = "short"           # a key of TASKS
    # independently built starts (warm-up policy + PRM, each from its own seeds): the outer
    # level of the design; start k's seed s pairs with GRPO's run of start k, seed s
    starts: int = 1
    methods: tuple = ALL_METHODS
    seeds: int = 5
    # fewer seeds for some methods (method -> seeds, at most `seeds`), e.g. {"rloo": 3}
    method_seeds: dict = field(default_factory=dict)
    oracle: tuple = ("grpo", "prof_grpo", "papo", "pure")
    rl_steps: int = 40
    hack_steps: int = 40          # the reward-hacking run (PURE on the PRM alone); 0 = none
    eval_problems: int = 1000
    sampled_n: int = 4            # samples per held-out problem at the rollout temperature
    warmup_steps: int = 400       # the demo's warm-up
    # the PRM recipe of docs/prm.md that reached held-out step AUROC 0.942 on this task in
    # 5.6 CPU minutes: random-init hidden-64 trunk, 20 head-only + N whole-model steps of 64
    # solutions, lr 2e-3 cosine, auxiliary LM loss on correct solutions
    prm_steps: int = 3000
    prm_examples: int = 16000
    prm_hidden: int = 64          # the random-init trunk's (prm_init "random")
    prm_layers: int = 4
    prm_init: str = "random"      # a key of PRM_INITS
    bootstrap_reps: int = 2000
    wandb: str = "offline"
    extra: list = field(default_factory=list)  # dotted overrides applied to every RL run

    def __post_init__(self):
        # deferred: keeps --help fast (the registry imports torch)
        from megaprm.algorithms.registry import METHODS

        self.methods = tuple(self.methods)
        self.oracle = tuple(self.oracle)
        self.method_seeds = dict(self.method_seeds)
        known = list(METHODS) + list(VARIANTS)
        for name, chosen in (("--methods", self.methods), ("--oracle", self.oracle),
                             ("--method-seeds", tuple(self.method_seeds))):
            bad = [m for m in chosen if m not in known]
            if bad:
                raise ValueError(f"{name}: unknown method(s) {bad}; choose from {known}")
        if not self.methods:
            raise ValueError("--methods: give at least one method, e.g. --methods grpo,prof_grpo")
        missing = [m for m in self.oracle if m not in self.methods]
        if missing:
            raise ValueError(f"--oracle {','.join(missing)}: an oracle row is compared with the "
                             f"method's learned row; add it to --methods as well")
        if self.task not in TASKS:
            raise ValueError(f"--task {self.task}: unknown task; choose from {list(TASKS)}")
        if self.prm_init not in PRM_INITS:
            raise ValueError(f"--prm-init {self.prm_init}: choose from {list(PRM_INITS)}")
        if self.starts < 1:
            raise ValueError(f"--starts {self.starts}: need at least 1 start")
        if self.seeds < 1 or self.rl_steps < 1 or self.eval_problems < 2:
            raise ValueError("--seeds and --rl-steps must be >= 1 and --eval-problems >= 2")
        bad = {m: k for m, k in self.method_seeds.items() if not 1 <= k <= self.seeds}
        if bad:
            raise ValueError(f"--method-seeds {bad}: each count must be between 1 and --seeds "
                             f"({self.seeds})")

    def seeds_of(self, method: str) -> int:
        return self.method_seeds.get(method, self.seeds)

    @property
    def arithmetic(self) -> ArithmeticConfig:
        return TASKS[self.task]

    def start_dir(self, start: int) -> str:
        """RUN_DIR/start{k}: start k's warm-up, PRM, baseline and RL cells."""
        return os.path.join(self.run_dir, f"start{start}")


@dataclass(frozen=True)
class RunSpec:
    method: str    # a registry method or a VARIANTS label
    prm: str       # learned | oracle | implicit
    seed: int
    hack: bool = False
    start: int = 0  # which start (warm-up + PRM) it runs from

    @property
    def name(self) -> str:
        return (f"hack-{self.method}-prm-only-s{self.seed}" if self.hack
                else f"{self.method}-{self.prm}-s{self.seed}")


def plan(ccfg: CompareConfig) -> list[RunSpec]:
    """Every run to make: start-major, then seed-major within a start (every row's seed 0, then
    seed 1, ...: a run cut short holds complete pairs with GRPO for its first seeds), learned
    before oracle within a seed; the reward-hacking run after start 0's cells (it pairs with
    start 0, seed 0)."""
    runs = []
    for k in range(ccfg.starts):
        for s in range(ccfg.seeds):
            for m in ccfg.methods:
                if s < ccfg.seeds_of(m):
                    runs.append(RunSpec(m, "implicit" if base_method(m) == "prime" else "learned",
                                        s, start=k))
            for m in ccfg.oracle:
                if m in READS_STEP_SCORES and s < ccfg.seeds_of(m):
                    runs.append(RunSpec(m, "oracle", s, start=k))
        if k == 0 and ccfg.hack_steps:
            runs.append(RunSpec("pure", "learned", 0, hack=True))
    return runs


def run_overrides(spec: RunSpec, ccfg: CompareConfig, sft_dir: str, prm_dir: str) -> list[str]:
    """The run's overrides. Paired design: every row's run with seed s gets `trainer.seed=s`,
    which fixes its prompts (seed*100_003 + block), its rollout sampling seeds (per step and
    rank) and its mini-batch order, and starts from the one warm-up policy: at step 0 every
    method's run of seed s samples exactly GRPO's responses of seed s."""
    method = base_method(spec.method)
    t = ccfg.arithmetic
    ov = [f"model.path={sft_dir}", f"prm.path={prm_dir}", "prm.kind=discriminative",
          f"data.arithmetic.num_ops=[{t.num_ops[0]}, {t.num_ops[1]}]",
          f"data.arithmetic.operand_max={t.operand_max}", f"data.arithmetic.ops={t.ops}",
          f"data.arithmetic.restate={str(t.restate).lower()}",
          f"rollout.max_tokens={MAX_TOKENS[ccfg.task]}",
          f"trainer.steps={ccfg.hack_steps if spec.hack else ccfg.rl_steps}",
          f"trainer.seed={spec.seed}", f"advantage.method={method}",
          f"trainer.wandb={ccfg.wandb}"]
    if spec.prm == "oracle":
        ov += ["prm.kind=oracle", "prm.path=null"]
    ov += METHOD_OVERRIDES.get(method, [])
    ov += VARIANTS.get(spec.method, (None, []))[1]
    if spec.hack:  # PURE's "PRM" reward mode: the process reward alone, no verifiable reward
        ov += ["advantage.pure.reward_mode=PRM"]
    return ov + list(ccfg.extra)


def held_out_problems(n: int, task: str = "short") -> list:
    """The held-out problems every run is evaluated on (the trainer's HELD_OUT_SEED)."""
    # deferred: keeps --help fast (trainer.data reads the config module and the datasets)
    from megaprm.trainer.rl.data import HELD_OUT_SEED

    return generate_problems(TASKS[task], n, seed=HELD_OUT_SEED)


def repo_relative(path: str) -> str:
    """`path` relative to the repository: what a committed result records (another machine's
    checkout has the same relative paths, not the same absolute ones)."""
    return os.path.relpath(os.path.abspath(path), REPO_ROOT)
