#!/usr/bin/env bash
# Installs the issue-33 references, each into a target dir of its own under .refs/ (git-ignored),
# for tests/refs/run_reference.py to run with PYTHONPATH=<that dir> on the venv's Python:
#   .refs/pylate         PyLate, which pins sentence-transformers 5.3 and transformers <= 5.3
#   .refs/flagembedding  FlagEmbedding (BGEM3FlagModel), on the venv's transformers and
#                        sentence-transformers
# --no-deps with an explicit list: torch, numpy, scipy, tokenizers (FlagEmbedding) and the rest
# come from the venv, so no second torch is downloaded. `datasets` (with pyarrow, pandas, dill,
# multiprocess) is in both lists only because both libraries import it at import time.
# Idempotent: a dir whose .installed names the same packages is kept.
# Usage: bash tests/refs/install.sh   (with the venv active, or PYTHON=/path/to/python)
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python}

DATASETS=(datasets==5.2.0 pyarrow==26.0.1 pandas==3.1.1 dill==0.4.1 multiprocess==0.70.19)
PYLATE=(pylate==1.6.0 sentence-transformers==5.3.0 transformers==5.3.0 tokenizers==0.22.2)
FLAGEMBEDDING=(flagembedding==1.4.2 peft==0.21.2 accelerate==1.15.0 psutil==7.2.2)

install() {
    local dir=$1
    shift
    if [[ -f $dir/.installed && "$(cat "$dir/.installed")" == "$*" ]]; then
        echo "$dir: up to date"
        return
    fi
    rm -rf "$dir"
    "$PYTHON" -m pip install -q --no-deps --no-compile --target "$dir" "$@" 2>&1 |
        { grep -v "is neither a file nor a directory" || true; }
    echo "$*" >"$dir/.installed"
    echo "$dir: installed $*"
}

install .refs/pylate "${PYLATE[@]}" "${DATASETS[@]}"
install .refs/flagembedding "${FLAGEMBEDDING[@]}" "${DATASETS[@]}"
