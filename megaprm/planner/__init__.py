"""`megaprm plan`: per-GPU memory and time of an RL step, from a config alone (no weights).

    hardware.py   GPU peak rates and the efficiencies applied to them (each constant cited)
    models.py     an HF config.json from a path, or the shipped copy for a recipe's model
    params.py     parameters per rank: Megatron's own stage built on the meta device
    memory.py     bytes per GPU by phase (train, rollout), each term named
    timing.py     seconds per phase from FLOPs and bytes over the device's peak rates
    plan.py       the plan of one layout, the search over layouts, the table and JSON

docs/plan.md writes the model down with its sources and its measured error.
"""
