#!/usr/bin/env bash
# The first GPU sessions' script (../shared/gpu/README.md): the GPU tier and a short demo in
# parallel (tiny models), then bench_actor on its GPU shapes alone. Results under $OUT.
# The multi-rank, offload, real-size step and compile checks: scripts/gpu_session.sh.
#   bash ../shared/gpu/prepare.sh            # here, once (.whl/ and .gpu/, git-ignored)
#   device run, carry [".whl", ".gpu"]:  bash .gpu/on-device.sh bash scripts/gpu_tier_session.sh
# Knobs (environment): T_PYTEST T_DEMO T_BENCH (timeouts, s), TESTS (pytest paths), DEMO=0 /
# BENCH=0 (skip one), DEMO_STEPS DEMO_EVAL ITERS BENCH_ARGS, PYTEST_ADDOPTS (e.g. -k).
# Used on one H200 and one H100 on 2026-11-26: scripts/results/gpu_h200/ and gpu_h100/,
# BENCHMARKS.md "Actor throughput on one H200" and "... on one H100".
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T_PYTEST=${T_PYTEST:-300}; T_DEMO=${T_DEMO:-240}; T_BENCH=${T_BENCH:-200}
TESTS=${TESTS:-"tests/gpu tests/parallel/test_device.py tests/rollout/test_vllm_engine.py"}
{ date -u; uptime; nvidia-smi; python3 -c "import torch,transformers,megatron.core as m;print(torch.__version__, torch.version.cuda, transformers.__version__, m.__version__)"; } > "$OUT/machine.txt" 2>&1
(timeout -k 10 "$T_PYTEST" python3 -m pytest -m gpu -q -rs -p no:cacheprovider --timeout 200 \
   --durations=0 --junitxml "$OUT/gpu_tier.xml" $TESTS > "$OUT/gpu_tier.log" 2>&1; echo "rc=$?" >> "$OUT/gpu_tier.log") &
P1=$!
if [ "${DEMO:-1}" = 1 ]; then
(timeout -k 10 "$T_DEMO" python3 -m megaprm.cli demo --nproc 1 --rl-steps ${DEMO_STEPS:-4} --eval-problems ${DEMO_EVAL:-16} \
   --run-dir /tmp/demo > /tmp/demo.log 2>&1; echo "rc=$?" >> /tmp/demo.log;
 tail -c 60000 /tmp/demo.log > "$OUT/demo.log"; cp /tmp/demo/demo.json "$OUT/" 2>/dev/null;
 for m in grpo pure; do cp /tmp/demo/rl/$m-s0/metrics.jsonl "$OUT/metrics_$m.jsonl" 2>/dev/null; done) &
P2=$!
fi
wait $P1 ${P2:-}
if [ "${BENCH:-1}" = 1 ]; then
uptime >> "$OUT/machine.txt"
timeout -k 10 "$T_BENCH" python3 scripts/bench_actor.py --iters ${ITERS:-3} ${BENCH_ARGS:-} --out "$OUT/bench_actor_gpu.json" > "$OUT/bench_actor.log" 2>&1; echo "rc=$?" >> "$OUT/bench_actor.log"
fi
tail -5 "$OUT/gpu_tier.log"; tail -3 "$OUT/demo.log" 2>/dev/null; tail -25 "$OUT/bench_actor.log"
