#!/usr/bin/env bash
# The GPU checks of one device call (../shared/gpu/README.md), one JSON per check
# (scripts/gpu_checks.py says what each measures):
#   1. step (the Qwen2.5-1.5B-shaped RL step beside `megaprm plan`), 2. offload: one at a time,
#   alone on the GPU (they time things); 3. collectives + multirank, side by side (correctness
#   only: tiny models, several ranks sharing GPU 0 over gloo, MEGAPRM_RANKS_SHARE_DEVICE=1);
#   compile (scripts/bench_actor.py's compile rows) only when CHECKS names it: its question
#   was answered on the H100 on 2026-11-28 (scripts/results/gpu_h100/session_2026-11-28/).
# Each check gets --budget (its timeout less 30 s): it stops itself and still writes its JSON
# with its trail (each stage reached, its second, the memory allocated) and what it finished.
# The device call returns at most 8 files: everything goes to $RESULTS and, after each check,
# into one $OUT/gpu_session.tgz (with summary.txt, a line per check, beside it).
# Budget: <= 9 minutes on one GPU with the default timeouts (T_STEP + T_OFFLOAD + T_CORRECT =
# 520 s, plus the start); the first H100 run had 110 / 60 / 180 s and all three ran out.
#   bash ../shared/gpu/prepare.sh            # here, once (.whl/ and .gpu/, git-ignored)
#   device run, carry [".whl", ".gpu"], timeout_s 590:
#     bash .gpu/on-device.sh bash scripts/gpu_session.sh
#   on the CPU, the dry run (each check's CPU-sized form; tests/gpu/test_session.py):
#     DRY=1 OUT=/tmp/gpu-dry bash scripts/gpu_session.sh
# MEGAPRM_COMMIT names the commit in each JSON where the device's copy has no .git.
# Knobs (environment): T_STEP T_OFFLOAD T_CORRECT T_COMPILE (timeouts, s), CHECKS (a subset,
# e.g. "offload step"), PYTHON (default python3), RESULTS (default $OUT-files), TIER=1 also
# runs the GPU tier (pytest -m gpu, T_PYTEST) first, as the earlier sessions did.
# The earlier sessions (GPU tier, demo, bench_actor) on one H200 and one H100 on 2026-11-26:
# scripts/results/gpu_h200/ and gpu_h100/.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
RES=${RESULTS:-${OUT%/}-files}; mkdir -p "$RES"  # outside $OUT: only the archive comes back
: > "$RES/summary.txt"  # this session's lines only
PY=${PYTHON:-python3}
CHECKS=${CHECKS:-"step offload collectives multirank"}
DRYFLAG=""; T=""
# the dry run is not budgeted (a shared 2-core CPU): 10 minutes a check
[ "${DRY:-0}" = 1 ] && DRYFLAG="--dry" && T=600
T_STEP=${T_STEP:-${T:-230}}; T_OFFLOAD=${T_OFFLOAD:-${T:-110}}; T_CORRECT=${T_CORRECT:-${T:-180}}
T_COMPILE=${T_COMPILE:-${T:-120}}; T_PYTEST=${T_PYTEST:-300}
{ date -u; uptime; command -v nvidia-smi >/dev/null && nvidia-smi
  $PY -c "import torch,transformers,megatron.core as m;print(torch.__version__, torch.version.cuda, transformers.__version__, m.__version__)"; } > "$RES/machine.txt" 2>&1

wanted() { case " $CHECKS " in *" $1 "*) return 0;; esac; return 1; }

# what comes back: one archive of $RES and the summary, rewritten after every check
# (a temporary name per process: collectives and multirank pack side by side)
pack() {
  local part="$RES.tgz.$BASHPID"
  tar czf "$part" -C "$RES" . 2>/dev/null && mv -f "$part" "$OUT/gpu_session.tgz"
  [ "$RES" != "$OUT" ] && cp "$RES/summary.txt" "$OUT/summary.txt" 2>/dev/null
  return 0
}

# run_check NAME TIMEOUT: the check's JSON (it stops itself at TIMEOUT - 30 s), or, where even
# that failed, one saying how it ended
run_check() {
  local name=$1 t=$2
  rm -f "$RES/$name.json"  # a JSON left by an earlier session must not stand for this one
  timeout -k 10 "$t" $PY scripts/gpu_checks.py "$name" $DRYFLAG --out "$RES" \
    --budget $((t - 30)) > "$RES/$name.log" 2>&1
  local rc=$?
  if [ ! -f "$RES/$name.json" ]; then
    echo "{\"check\": \"$name\", \"ok\": false, \"error\": \"ended with exit code $rc before writing its JSON (124: over its ${t} s timeout)\"}" > "$RES/$name.json"
  fi
  tail -1 "$RES/$name.log" | tee -a "$RES/summary.txt"
  pack
}

if [ "${TIER:-0}" = 1 ] && [ -z "$DRYFLAG" ]; then
  timeout -k 10 "$T_PYTEST" $PY -m pytest -m gpu -q -rs -p no:cacheprovider --timeout 200 \
    --junitxml "$RES/gpu_tier.xml" tests/gpu tests/parallel/test_device.py > "$RES/gpu_tier.log" 2>&1
  tail -3 "$RES/gpu_tier.log" | tee -a "$RES/summary.txt"
  pack
fi
wanted step && run_check step "$T_STEP"
wanted offload && run_check offload "$T_OFFLOAD"
pids=()
for c in collectives multirank; do
  if wanted $c; then run_check $c "$T_CORRECT" & pids+=($!); fi
done
[ ${#pids[@]} -gt 0 ] && wait "${pids[@]}"
wanted compile && run_check compile "$T_COMPILE"
uptime >> "$RES/machine.txt"
pack
ls "$RES"
