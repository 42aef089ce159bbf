"""`megaprm data`: a plain question file written in a recipe's released row layout
(`tasks.convert`). It reads the recipe (megaprm.config, which sits above tasks/), hence here,
beside the trainer's own prompt data (trainer/data.py).
"""
from __future__ import annotations


def add_parser(sub) -> None:
    dt = sub.add_parser("data", help="write a plain question file (JSONL/parquet) in a recipe's "
                                     "released row layout (PRIME, PROF-GRPO, PAPO, PURE)",
                        description="Read a prompt file of plain questions (fields problem | "
                        "question | prompt, answer | final_answer | a \\boxed{} in solution; "
                        "PAPO's grader also reads solution or reference_solution) and write it "
                        "in the row layout of the recipe's release: its system message and "
                        "instruction (data.system_prompt, data.prompt_template) put where the "
                        "release's preprocessing puts them. megaprm train renders the same "
                        "prompt from either file; the converted one also runs in the released "
                        "code. Rows of another layout are skipped and reported.")
    dt.add_argument("config", help="the recipe whose prompt settings apply, e.g. "
                                   "configs/prime.yaml")
    dt.add_argument("overrides", nargs="*", help="section.key=value, e.g. "
                                                 "data.prompt_template='{question}'")
    dt.add_argument("--in", dest="src", required=True, metavar="FILE",
                    help="the plain question file (.jsonl or .parquet)")
    dt.add_argument("--out", required=True, metavar="FILE",
                    help="the converted file; .parquet (as the verl-based releases read) or "
                    ".jsonl. Never the input; an existing file only with --force")
    dt.add_argument("--layout", default=None, choices=("prime", "prof_grpo", "papo", "pure"),
                    help="the release's layout (default: the recipe's advantage.method)")
    dt.add_argument("--force", action="store_true", help="replace an existing --out file")
    dt.set_defaults(fn=run)


def run(args) -> int:
    # deferred: keeps --help fast
    from megaprm.config import load_config
    from megaprm.tasks.convert import LAYOUTS, convert

    cfg = load_config(args.config, args.overrides)
    layout = args.layout or cfg.advantage.method
    if layout not in LAYOUTS:
        raise ValueError(f"{args.config} is a {layout} recipe, which has no released row "
                         f"layout; pass --layout {' | '.join(LAYOUTS)}")
    rows, _ = convert(args.src, args.out, layout, cfg.data, force=args.force, log=print)
    print(f"[megaprm] data: wrote {len(rows)} rows in {layout}'s released layout to {args.out}")
    if layout == "papo":
        missing = sum(not r["extra_info"]["reference_solution"] for r in rows)
        if missing:
            print(f"[megaprm] data: {missing} rows have no reference solution (no `solution` or "
                  "`reference_solution` field); PAPO's grader scores their process grade 0")
    return 0
