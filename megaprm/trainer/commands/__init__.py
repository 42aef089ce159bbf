"""The commands the trainer package owns, one module each with `add_parser(sub)` and
`run(args)`; megaprm/cli.py composes them. Light at import (the parser is built from them
for `megaprm --help`): everything heavy is imported inside `run`.

    train       `megaprm train`: RL from a recipe
    train_prm   `megaprm train-prm`: a discriminative PRM
    eval_prm    `megaprm eval-prm`: judge a PRM (prm_judge)
    plot        `megaprm plot`: a run's curves (plots.py)
    plan        `megaprm plan`: the planner, after the trainer's launch checks
    data        `megaprm data`: a question file in a recipe's released row layout
"""
