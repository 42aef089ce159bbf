"""`python -m checkpoint_tools {import-hf,export-hf,verify}`; user errors print one line.

Runs as one process that launches its own tp*pp local ranks, or under torchrun as one of them
(`torchrun --nproc-per-node 4 -m checkpoint_tools import-hf ... --tp 2 --pp 2`).
"""
from __future__ import annotations

import argparse
import atexit
import functools
import json
import os
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m checkpoint_tools",
                                description="HF <-> Megatron distributed checkpoint conversion")
    sub = p.add_subparsers(dest="command", required=True)

    imp = sub.add_parser("import-hf", help="HF safetensors dir -> Megatron distributed checkpoint")
    imp.add_argument("--hf", required=True, help="HF model dir (config.json + safetensors)")
    imp.add_argument("--out", required=True, help="checkpoint dir to create")
    imp.add_argument("--tp", type=int, default=1)
    imp.add_argument("--pp", type=int, default=1)
    imp.add_argument("--ep", type=int, default=1,
                     help="expert parallelism of an MoE model (ranks = tp*pp*ep)")
    imp.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                     help="stored dtype (default: the HF config's dtype)")

    exp = sub.add_parser("export-hf", help="Megatron distributed checkpoint -> HF safetensors dir")
    exp.add_argument("--ckpt", required=True,
                     help="checkpoint dir written by import-hf, or a trainer run dir, "
                          "checkpoints/ dir or step dir")
    exp.add_argument("--out", required=True, help="HF dir to create")
    exp.add_argument("--max-shard-size", default="5GB")
    exp.add_argument("--tp", type=int, default=None, help="tp to load with (default: as saved)")
    exp.add_argument("--pp", type=int, default=None, help="pp to load with (default: as saved)")
    exp.add_argument("--ep", type=int, default=1, help="expert parallelism to load an MoE "
                     "model with (the checkpoint loads at any ep)")

    for s in (imp, exp):
        s.add_argument("--force", action="store_true", help="replace an existing --out")
        s.add_argument("--no-verify", action="store_true",
                       help="skip the transformers-vs-Megatron logit check (the weights "
                            "then go file to file where the layout allows it; see "
                            "docs/checkpoint_tools.md)")

    ver = sub.add_parser("verify", help="compare transformers and Megatron outputs")
    ver.add_argument("--hf", required=True)
    ver.add_argument("--ckpt", required=True, help="as export-hf's --ckpt")
    ver.add_argument("--tp", type=int, default=1)
    ver.add_argument("--pp", type=int, default=1)
    ver.add_argument("--ep", type=int, default=1, help="expert parallelism of an MoE model")
    ver.add_argument("--atol", type=float, default=None, help="max abs logit diff allowed")
    ver.add_argument("--min-top1", type=float, default=None, help="min top-1 agreement")
    for s in (exp, ver):
        s.add_argument("--model", choices=["actor", "prm"], default="actor",
                       help="which model of a trainer checkpoint (default: actor)")
    return p


def lean_imports() -> None:
    """Import torch and megatron-core for a conversion process, ~2 s (of ~4.5 s) cheaper.

    megatron-core decorates its fused kernels with `torch.compile` at import time, which
    imports torch._dynamo and torch._inductor (~1.6 s on a 2-core VM) although a conversion never calls
    them; during the import, `torch.compile` defers to the real one at a function's first call
    (compiled then, exactly as before). And its inference context imports wandb if installed
    (~0.6 s); a conversion logs nothing, so wandb is unimportable while megatron-core is
    imported (it then takes wandb as absent) and importable again afterwards. Only the CLI
    process and its spawned ranks do this."""
    import torch

    # deferred: this function is the import of torch and megatron-core, tuned
    import megaprm  # noqa: F401 - first: its import silences megatron-core's TE/Apex fallbacks

    real = torch.compile

    def deferred(model=None, **kw):
        if model is None:  # used as @torch.compile(...)
            return lambda m: deferred(m, **kw)
        compiled = None

        @functools.wraps(model)
        def call(*a, **k):
            nonlocal compiled
            if compiled is None:
                compiled = real(model, **kw)
            return compiled(*a, **k)

        return call

    hide_wandb = "wandb" not in sys.modules
    if hide_wandb:
        sys.modules["wandb"] = None  # `import wandb` raises ImportError while this is set
    torch.compile = deferred
    try:
        import megatron.core.dist_checkpointing
        import megatron.core.models.gpt  # noqa: F401
    finally:
        torch.compile = real
        if hide_wandb and sys.modules.get("wandb", 0) is None:
            del sys.modules["wandb"]  # later imports (e.g. in a caller's process) see it again


def _os_cause(e: BaseException):
    """The OSError that `e` is or wraps (dist_checkpointing wraps its writers' errors)."""
    for _ in range(10):
        if e is None or isinstance(e, OSError):
            return e
        e = e.__cause__ or e.__context__
    return None


def main(argv=None, fork_ranks: bool = False) -> int:
    """The CLI. `fork_ranks`: start local ranks as forks of this process (`ranks.RANK_START`);
    only `python -m checkpoint_tools` says so, where this process has done no torch work yet
    (a caller's process may hold an OpenMP pool or threads, which a fork does not survive)."""
    # deferred: `--help` stays free of megaprm's package imports (launch itself: stdlib only)
    from megaprm.parallel import launch

    args = _parser().parse_args(argv)
    if not (args.command == "export-hf" and args.no_verify and not launch.under_torchrun()):
        # an export without verification streams file to file in this process and needs
        # neither megatron-core nor a model (`streaming`); its fallback imports them as needed
        lean_imports()
    # deferred: after the arguments are checked and `lean_imports` has run (torch, megatron)
    from checkpoint_tools import convert, ranks
    from checkpoint_tools.layout import ConversionError, os_error_line  # deferred: as above

    if fork_ranks:
        ranks.RANK_START = "fork"
    if launch.under_torchrun():  # each rank's group goes down before its interpreter does
        atexit.register(ranks.teardown)

    leader = int(os.environ.get("RANK", "0")) == 0
    try:
        if args.command == "import-hf":
            report = convert.import_hf(args.hf, args.out, tp=args.tp, pp=args.pp, ep=args.ep,
                                       dtype=args.dtype, force=args.force,
                                       verify=not args.no_verify)
        elif args.command == "export-hf":
            report = convert.export_hf(args.ckpt, args.out, tp=args.tp, pp=args.pp, ep=args.ep,
                                       max_shard_size=args.max_shard_size, force=args.force,
                                       verify=not args.no_verify, model=args.model)
        else:
            report = convert.verify(args.hf, args.ckpt, tp=args.tp, pp=args.pp, ep=args.ep,
                                    atol=args.atol, min_top1=args.min_top1, model=args.model)
    except ConversionError as e:
        if leader:
            print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line; the target's .tmp is already discarded
        if leader:
            print("error: stopped by SIGINT (Ctrl-C); nothing was written to the target",
                  file=sys.stderr)
        return 128 + 2
    except Exception as e:  # noqa: BLE001 - a full disk or a permission, however wrapped: the
        cause = _os_cause(e)  # file and the reason in one line, not a traceback
        if cause is None:
            raise
        if leader:
            print(f"error: {os_error_line(cause)}", file=sys.stderr)
        return 2
    if leader:
        print(json.dumps(report, indent=2))
    return 0 if report.get("passed", True) else 1


if __name__ == "__mp_main__":  # a spawned rank re-imports this module: import lean there too
    lean_imports()
if __name__ == "__main__":
    sys.exit(main(fork_ranks=True))
