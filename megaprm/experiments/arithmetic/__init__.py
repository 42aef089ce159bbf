"""The arithmetic task's experiments, where every step of every solution is checked exactly.

Imports go one way (each module imports only those listed before it):

* `runs`: the task, the RL settings, the methods and their knobs, what one run is
  (`RunSpec` -> `run_overrides`); light, the CLI's parser reads it;
* `stats`: the intervals (Wilson, the two-level bootstrap, t-intervals over seeds);
* `start`: the warm-up policy and the PRM every run starts from (trained, cached, shipped);
* `demo`: `megaprm demo`, one seed of two methods from the shipped start;
* `report`: the comparison's table, README block and plots, from compare.json alone;
* `compare`: `megaprm compare`, the driver of every (method, process reward, seed) run.
* `demo_command`, `compare_command`: the two commands' parsers and runs, which the CLI
  composes (light at import, as `runs`).
"""
