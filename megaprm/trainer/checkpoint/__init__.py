"""Trainer checkpoints: atomic, verified, resumable; each model in checkpoint_tools' format.

Layout of `ckpt_root/` (docs/architecture.md "One checkpoint format"):

    step_000004/                 one complete checkpoint
      actor/                     a checkpoint_tools checkpoint of the actor (`export-hf` takes it)
        model/                   dist_checkpointing of the weights (loadable at any tp/pp)
        hf/                      HF side files of the model (config.json, tokenizer, ...)
        megaprm_checkpoint.json  checkpoint_tools.layout.CheckpointMeta
      prm/                       the same for an online-updated PRM (PRIME), if any
      rank_00000.pt              this rank's optimiser state(s) (with Megatron's distributed
                                 optimizer: this rank's shard of fp32 masters and Adam moments,
                                 `optimizer.Optimizer.state_dict`) and RNG states
      trainer.json               step, next_step, skipped_steps, world/tp/pp, config digest
      MANIFEST.json              size + crc32 of every other file; written last
    step_000002.damaged/         a checkpoint that failed verification (kept for inspection)
    latest                       text file naming the newest complete checkpoint (a hint)

The modules, one job each:
* `store`: the step directories (names, `latest`, leftovers, pruning), the MANIFEST check of
  one step, the collectives every phase agrees through, `CheckpointError`;
* `save`: writing step N in agreed phases (`save.save`);
* `load`: choosing the newest intact step and restoring from it (`load.load`);
* `run_dir`: a fresh start in a directory that holds an earlier run.

Save: every check is agreed by all ranks (an all-reduce of a failure flag), so either every rank
returns or every rank raises the same CheckpointError; none raises while another waits.
  1. weights finite on every rank (non-finite weights are never saved),
  2. rank 0 removes leftovers (`*.tmp`) and creates `step_N.tmp/`,
  3. dist_checkpointing of each model, the rank files, trainer.json,
  4. MANIFEST.json (each rank checksums a share of the files; rank 0 writes it),
  5. rank 0 renames `step_N.tmp` -> `step_N`, rewrites `latest`, prunes to `keep_last`.
A failure in 2-5 (e.g. ENOSPC) removes `step_N.tmp` and raises one line; the previous
checkpoint is untouched. A crash leaves either a `.tmp` (removed by the next save) or a
complete `step_N` that `latest` does not name yet (adopted by the next load).

Load: the newest `step_N` whose MANIFEST verifies is used; a damaged one is reported in one
line, renamed to `step_N.damaged` and the previous intact one is used (or, with
`fallback=False`, the load refuses). Optimiser states are per rank, so a resume needs the same
world/tp/pp; the weights alone reshard freely (checkpoint_tools). A checkpoint written under
another config (digest of the sub-config the trainer passes) is refused, naming the keys.
"""
