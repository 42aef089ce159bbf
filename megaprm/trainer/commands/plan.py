"""`megaprm plan`: the planner's memory and time per GPU of a recipe (megaprm/planner/). Here,
not in planner/, because it runs the trainer's own launch checks first
(`preflight.check_launch_layout`): plan never says "fits" where train would refuse.
"""
from __future__ import annotations


def add_parser(sub) -> None:
    pn = sub.add_parser("plan", help="per-GPU memory by phase, fits or not, and time per step, "
                                     "from a recipe and the models' config.json (no weights)",
                        description="Plan an RL recipe on N GPUs before any rank starts: "
                        "parameters per GPU (Megatron's stage built on the meta device), memory "
                        "of the update and of the rollout, the verdict with the largest terms "
                        "and the overrides that would make it fit, and time per phase. The "
                        "model, its constants and measured error: docs/plan.md.")
    pn.add_argument("config", help="YAML recipe, e.g. configs/prof_grpo.yaml")
    pn.add_argument("overrides", nargs="*", help="section.key=value, e.g. parallel.tp=4")
    pn.add_argument("--gpus", type=int, default=8, help="GPUs in the run (default 8)")
    pn.add_argument("--gpu", default="h100",
                    help="h100 | h200 | a100 | h20 | b200 | gb200 | mi300x (default h100)")
    pn.add_argument("--gpu-spec", default=None,
                    help="a GPU from its datasheet instead of --gpu: name=...,tflops=(dense "
                    "BF16),hbm_tbps=...,mem_gb=...[,link_gbps=(one way)]")
    pn.add_argument("--gpu-mem", type=float, default=None,
                    help="GB per GPU (default: the --gpu's own)")
    pn.add_argument("--prompt-tokens", type=int, default=None,
                    help="longest prompt (default data.max_prompt_tokens, else 1024)")
    pn.add_argument("--mean-response", type=float, default=None,
                    help="expected response length for the times (default rollout.max_tokens)")
    pn.add_argument("--max-response", type=float, default=None,
                    help="the longest response of a step's batch, which a synchronous step "
                    "waits for (default rollout.max_tokens)")
    pn.add_argument("--search", action="store_true",
                    help="also rank the tp/pp layouts that fit by predicted step time")
    pn.add_argument("--json", action="store_true", help="print the same numbers as JSON")
    pn.set_defaults(fn=run)


def run(args) -> int:
    import json

    # deferred: keeps --help fast
    from megaprm.config import load_config, read_yaml_with_overrides
    from megaprm.planner import plan as planner
    from megaprm.planner.hardware import gpu_of
    from megaprm.trainer.preflight import check_launch_layout

    gpu = gpu_of(args.gpu, args.gpu_mem, args.gpu_spec)
    if args.gpus < 1:
        raise ValueError(f"--gpus {args.gpus} must be a positive number of GPUs")
    for flag, v in (("--prompt-tokens", args.prompt_tokens),
                    ("--mean-response", args.mean_response),
                    ("--max-response", args.max_response)):
        if v is not None and not v > 0:
            raise ValueError(f"{flag} {v!r} must be a positive number of tokens")
    cfg = load_config(args.config, args.overrides)
    # the launcher's own layout checks first: plan never says "fits" where train would refuse
    check_launch_layout(cfg, args.gpus)
    raw = read_yaml_with_overrides(args.config, args.overrides, example="configs/prof_grpo.yaml",
                                   override_example="parallel.tp=2")
    w, sources = planner.workload_of(cfg, raw, args.gpus, prompt_tokens=args.prompt_tokens,
                                     mean_response=args.mean_response,
                                     max_response=args.max_response)
    plan = planner.plan_workload(w, gpu, sources=sources, knobs_of=planner.override_keys(cfg))
    found = planner.search(w, gpu) if args.search else None
    if args.json:
        out = planner.to_json(plan)
        if found is not None:
            out["search"] = [planner.to_json(p) for p in found]
        print(json.dumps(out, indent=1))
    else:
        print(planner.table(plan))
        if found is not None:
            print(f"\nlayouts that fit on {w.world} x {gpu.name.upper()}, fastest first:")
            print(planner.search_table(found))
    return 0
