#!/usr/bin/env bash
# Issue 11 on the two-H200 machine: the README's multi-host commands (`embed` and `serve`) run
# as two "hosts" (torchrun --nnodes 2 --node-rank 0|1 --nproc-per-node 1, CUDA_VISIBLE_DEVICES=0
# and =1, NCCL), compared with PP=1 and with transformers by the bf16 contract (docs/design.md §3);
# then the GPU tests that cover in-process PP=2 across the two GPUs and the NCCL fault check.
# Run from the repository root, with .gpu/minilm holding all-MiniLM-L6-v2's tokenizer files
# (BENCHMARKS.md, "How to reproduce") and .whl the server's wheels (BENCHMARKS.md, "Data
# parallelism": that machine has no fastapi or uvicorn). The JSON report lands in
# /tmp/res/torchrun/.
set -u
DEPS=/tmp/pp11deps
python3 -c "import fastapi, uvicorn" 2>/dev/null \
    || python3 -c "import glob, zipfile; [zipfile.ZipFile(w).extractall('$DEPS') for w in glob.glob('.whl/*.whl')]"
export PYTHONPATH=$PWD/src:$DEPS PIPEPOOL_MINILM_DIR=$PWD/.gpu/minilm NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -c "import sys; sys.path.insert(0,'benchmarks'); import gpu_suite; gpu_suite.build_checkpoint('0.6b')"
python3 benchmarks/torchrun_gpu.py --model /tmp/pipepool-bench/0.6b-shape --serve --out /tmp/res/torchrun
echo "torchrun_gpu exit code: $?"
python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "pp2 or inproc"
