#!/usr/bin/env bash
# The issue-10 figures of BENCHMARKS.md: the GPU test suite, start-up, W4 / T4 / W1 on the
# all-MiniLM-L6-v2 shape and W1 on the Qwen3-0.6B shape, each against its peer in the same
# run. Run from the repository root on the GPU machine, with .gpu/minilm holding the
# tokenizer and sentence-transformers files of all-MiniLM-L6-v2 (BENCHMARKS.md, "How to
# reproduce"). Rows land in /tmp/res/*/suite.json.
export PYTHONPATH=$PWD/src PIPEPOOL_MINILM_DIR=$PWD/.gpu/minilm NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=true
python3 -c "import sys; sys.path.insert(0,'benchmarks'); import gpu_suite; [gpu_suite.build_checkpoint(k) for k in ('minilm','0.6b')]"
M=/tmp/pipepool-bench/minilm-shape
python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_qk_rope_kernel.py
python3 benchmarks/startup.py --model $M
python3 benchmarks/startup.py --model $M compile=false
python3 benchmarks/gpu_suite.py --runs minilm:W4::--gpu-busy --out /tmp/res/w4
python3 benchmarks/gpu_suite.py --runs minilm:W4::--no-compile+--no-peer+--gpu-busy --out /tmp/res/w4nc
python3 benchmarks/gpu_suite.py --runs minilm:T4::--gpu-busy --out /tmp/res/t4
python3 benchmarks/gpu_suite.py --runs minilm:W1::--no-e2e --out /tmp/res/w1
python3 benchmarks/gpu_suite.py --runs 0.6b:W1::--no-e2e+--gpu-busy --out /tmp/res/w106
