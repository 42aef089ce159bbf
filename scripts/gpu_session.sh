#!/usr/bin/env bash
# The GPU checks of one device call (../shared/gpu/README.md), one JSON per check under $OUT
# (scripts/gpu_checks.py says what each measures):
#   1. collectives + multirank, side by side (correctness only: tiny models, several ranks
#      sharing GPU 0 over gloo, MEGAPRM_RANKS_SHARE_DEVICE=1)
#   2. offload, 3. step (the Qwen2.5-1.5B-shaped RL step beside `megaprm plan`), 4. compile:
#      one at a time, alone on the GPU (they time things)
# Budget: <= 8 minutes on one GPU with the default timeouts (T_CORRECT + T_OFFLOAD + T_STEP +
# T_COMPILE = 470 s, plus the start). A check that runs out of time leaves a JSON saying so.
#   bash ../shared/gpu/prepare.sh            # here, once (.whl/ and .gpu/, git-ignored)
#   device run, carry [".whl", ".gpu"]:  bash .gpu/on-device.sh bash scripts/gpu_session.sh
#   on the CPU, the dry run (each check's CPU-sized form; tests/gpu/test_session.py):
#     DRY=1 OUT=/tmp/gpu-dry bash scripts/gpu_session.sh
# MEGAPRM_COMMIT names the commit in each JSON where the device's copy has no .git.
# Knobs (environment): T_CORRECT T_OFFLOAD T_STEP T_COMPILE (timeouts, s), CHECKS (a subset,
# e.g. "offload step"), PYTHON (default python3), TIER=1 also runs the GPU tier
# (pytest -m gpu, T_PYTEST) first, as the earlier sessions did.
# The earlier sessions (GPU tier, demo, bench_actor) on one H200 and one H100 on 2026-11-26:
# scripts/results/gpu_h200/ and gpu_h100/.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
CHECKS=${CHECKS:-"collectives multirank offload step compile"}
DRYFLAG=""; T=""
# the dry run is not budgeted (a shared 2-core CPU): 10 minutes a check
[ "${DRY:-0}" = 1 ] && DRYFLAG="--dry" && T=600
T_CORRECT=${T_CORRECT:-${T:-180}}; T_OFFLOAD=${T_OFFLOAD:-${T:-60}}; T_STEP=${T_STEP:-${T:-110}}
T_COMPILE=${T_COMPILE:-${T:-120}}; T_PYTEST=${T_PYTEST:-300}
{ date -u; uptime; command -v nvidia-smi >/dev/null && nvidia-smi
  $PY -c "import torch,transformers,megatron.core as m;print(torch.__version__, torch.version.cuda, transformers.__version__, m.__version__)"; } > "$OUT/machine.txt" 2>&1

wanted() { case " $CHECKS " in *" $1 "*) return 0;; esac; return 1; }

# run_check NAME TIMEOUT: the check's JSON, or one saying how it ended
run_check() {
  local name=$1 t=$2
  timeout -k 10 "$t" $PY scripts/gpu_checks.py "$name" $DRYFLAG --out "$OUT" > "$OUT/$name.log" 2>&1
  local rc=$?
  if [ ! -f "$OUT/$name.json" ]; then
    echo "{\"check\": \"$name\", \"ok\": false, \"error\": \"ended with exit code $rc before writing its JSON (124: over its ${t} s timeout)\"}" > "$OUT/$name.json"
  fi
  tail -1 "$OUT/$name.log"
}

if [ "${TIER:-0}" = 1 ] && [ -z "$DRYFLAG" ]; then
  timeout -k 10 "$T_PYTEST" $PY -m pytest -m gpu -q -rs -p no:cacheprovider --timeout 200 \
    --junitxml "$OUT/gpu_tier.xml" tests/gpu tests/parallel/test_device.py > "$OUT/gpu_tier.log" 2>&1
  tail -3 "$OUT/gpu_tier.log"
fi
pids=()
for c in collectives multirank; do
  if wanted $c; then run_check $c "$T_CORRECT" & pids+=($!); fi
done
[ ${#pids[@]} -gt 0 ] && wait "${pids[@]}"
wanted offload && run_check offload "$T_OFFLOAD"
wanted step && run_check step "$T_STEP"
wanted compile && run_check compile "$T_COMPILE"
uptime >> "$OUT/machine.txt"
ls "$OUT"
