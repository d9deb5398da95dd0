#!/usr/bin/env bash
# Issue 12: where PP=2 loses against PP=1. Qwen3-8B shape (random bf16 weights from the real
# config), W1 (4096 requests of 16-512 tokens), engine only: PP=1 traced, PP=2 traced, PP=2
# untraced (the cost of tracing, same call). About 6 minutes on the two-H200 machine, most of
# it building the checkpoint and starting engines.
#
# Run from the repository root, with .gpu/minilm holding all-MiniLM-L6-v2's tokenizer files
# (BENCHMARKS.md, "How to reproduce"). Everything lands in $OUT (default /tmp/res12): the
# bench logs (pp1.log, pp2.log, pp2-off.log), each run's suite.json (rows, with a traced run's
# summary under "trace"), pp1.json and pp2.json (Chrome traces of the timed passes: open them in
# ui.perfetto.dev), matmul.txt, gpus-*.csv and report.txt.
set -u
export PYTHONPATH=$PWD/src PIPEPOOL_MINILM_DIR=$PWD/.gpu/minilm NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=true
OUT=${OUT:-/tmp/res12}
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv \
    > "$OUT/gpus-before.csv" 2>&1
python3 benchmarks/gpu_matmul.py > "$OUT/matmul.txt" 2>&1
# MODEL, REQUESTS and EXTRA only for a dry run elsewhere, e.g. on a CPU:
# MODEL=minilm REQUESTS=32 EXTRA=+--device+cpu OUT=/tmp/dry bash benchmarks/gpu_issue12.sh
M=${MODEL:-8b}:W1:${REQUESTS:-}
# One warm-up pass and one timed pass, as the figures were measured (a pass of 8B W1
# takes ~25 s at PP=1: steady, and minutes count here).
FLAGS="--no-peer+--no-e2e+--warm-up-passes+1+--passes+1${EXTRA:-}"
# One suite call per run, the report after each: a run cut short by the time limit leaves
# the earlier ones' results and report in $OUT.
report() {
    python3 benchmarks/trace_report.py --suite "$OUT/pp1/suite.json" --suite "$OUT/pp2/suite.json" \
        --suite "$OUT/pp2-off/suite.json" "$OUT/pp1.json" "$OUT/pp2.json" > "$OUT/report.txt" 2>&1
}
for run in "pp1:$M:$FLAGS+--trace+$OUT/pp1.json" "pp2:$M:--pp+2+$FLAGS+--trace+$OUT/pp2.json" \
           "pp2-off:$M:--pp+2+$FLAGS"; do
    name=${run%%:*}
    python3 benchmarks/gpu_suite.py --out "$OUT/$name" --runs "${run#*:}" > "$OUT/$name.log" 2>&1
    echo "[$name] exit $? at ${SECONDS}s"
    grep -E "fused|Error|Traceback|timeline|^stage|bubble|driver:" "$OUT/$name.log" | tail -12
    report
done
nvidia-smi --query-gpu=index,clocks.sm,power.draw,temperature.gpu --format=csv > "$OUT/gpus-after.csv" 2>&1
ls -la "$OUT"
cat "$OUT/matmul.txt" "$OUT/gpus-before.csv" "$OUT/gpus-after.csv" "$OUT/report.txt"
