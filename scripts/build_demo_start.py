"""Build the demo's start (warm-up policy + PRM) from scratch and optionally ship it into the
package (megaprm/assets/demo/). Run on 2 ranks, as `megaprm demo` does:

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc-per-node 2 scripts/build_demo_start.py runs/demo_start
    .venv/bin/python scripts/build_demo_start.py --ship runs/demo_start

`megaprm demo --from-scratch` runs the same build (megaprm.experiments.arithmetic.start.build) and reports whether
its tensors equal the shipped ones.
"""
import sys


def main() -> int:
    from megaprm.experiments.arithmetic import start

    if sys.argv[1:2] == ["--ship"]:
        man = start.ship(sys.argv[2])
        print(f"shipped {sys.argv[2]} -> {start.SHIPPED_DIR} (recipe {man['digest']}, "
              f"AUROC {man['prm_eval']['auroc']:.3f})")
        return 0
    from megaprm.parallel.init import destroy, init_distributed
    from megaprm.tasks.tokenizer import build_char_tokenizer

    out = sys.argv[1]
    budget = [int(x) for x in sys.argv[2:5]]  # optional: warmup_steps prm_steps prm_examples
    groups = init_distributed(tp=1, pp=1, seed=0)
    rec = start.recipe(*budget)
    say = print if groups.rank == 0 else (lambda *a, **k: None)
    man = start.build(out, rec, groups, build_char_tokenizer(), say)
    say(f"built {out}: AUROC {man['prm_eval']['auroc']:.3f}, times {man['build']}")
    destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
