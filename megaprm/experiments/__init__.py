"""Experiments built on the public trainer API: what `megaprm demo` and `megaprm compare` run.
Only the CLI imports them; nothing under megaprm/ below this package does. `readme` writes a
command's results into the generated blocks of README.md and docs/."""
