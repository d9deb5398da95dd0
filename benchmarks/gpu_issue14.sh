#!/usr/bin/env bash
# The issue-14 figures of BENCHMARKS.md: data-parallel replicas through the server, DP=2 vs DP=1
# on two GPUs (all-MiniLM-L6-v2 shape W4, target >= 1.8x; Qwen3-0.6B shape W1, target >= 1.9x).
# One call, about 8 minutes.
# Run from the repository root on the two-H200 machine, with .gpu/minilm holding the
# all-MiniLM-L6-v2 tokenizer files and .whl the server wheels for cp312 (fastapi, uvicorn,
# uvloop, httptools and their dependencies: `pip download` line in BENCHMARKS.md, "Data
# parallelism").
set -u
DEPS=/tmp/pp14deps
if ! python3 -c "import fastapi, uvicorn, httpx, uvloop, httptools" 2>/dev/null; then
    # pip when there is one; a wheel is a zip file, so unpacking them works as well.
    python3 -m pip install -q --no-index --find-links .whl --target "$DEPS" fastapi uvicorn httpx uvloop httptools \
        || python3 -c "import glob, zipfile; [zipfile.ZipFile(w).extractall('$DEPS') for w in glob.glob('.whl/*.whl')]"
fi
export PYTHONPATH=$PWD/src:$DEPS PIPEPOOL_MINILM_DIR=$PWD/.gpu/minilm NCCL_NVLS_ENABLE=0
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=true
nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader
python3 -c "import sys; sys.path.insert(0,'benchmarks'); import gpu_suite; [gpu_suite.build_checkpoint(k) for k in ('minilm','0.6b')]"
B=/tmp/pipepool-bench
# MiniLM W4 (8192 queries, median 32 tokens): 64 queries per request, 12 API server processes
# (one front-end process is the limit of any DP at these rates), 256 requests in flight (both
# configurations at saturation), passes of 48 sends of the workload (long against their ramp).
timeout 330 python3 benchmarks/dp_server.py --model $B/minilm-shape --workload W4 \
    --inputs-per-request 64 --passes 3 --repeat 48 --clients 16 --concurrency 256 \
    --flags "--max-model-len 512" \
    --variant 'dp1|CUDA_VISIBLE_DEVICES=0|--api-server-count 12' \
    --variant 'dp2||--dp 2 --api-server-count 12' \
    --variant 'dp1-b|CUDA_VISIBLE_DEVICES=0|--api-server-count 12' \
    --variant 'dp2-b||--dp 2 --api-server-count 12'
# Qwen3-0.6B W1 (4096 requests of 16-512 tokens): 4 per request, 64 requests in flight.
timeout 190 python3 benchmarks/dp_server.py --model $B/0.6b-shape --workload W1 \
    --inputs-per-request 4 --passes 2 \
    --variant 'dp1|CUDA_VISIBLE_DEVICES=0|' \
    --variant 'dp2||--dp 2'
