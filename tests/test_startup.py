"""Issue 15 items 4-6: a quick start. ``import pipepool``, ``pipepool --help`` and
``--version`` import no torch; ``pipepool serve`` without the server extras says which extra to
install in one line; the base install needs none of transformers, sentence-transformers,
scipy or scikit-learn (the README installs the bundled model without them)."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pipepool

_NO_TORCH = "import sys\nsys.modules['torch'] = None  # importing torch now raises ImportError\n"


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPEPOOL_")}
    env["PYTHONPATH"] = str(Path(pipepool.__file__).parents[1])
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_import_help_and_version_need_no_torch():
    code = (
        _NO_TORCH + "import pipepool\nfrom pipepool.cli import main\nsys.exit(main(sys.argv[1:]))"
    )
    r = _python(code, "--help")
    assert r.returncode == 0, r.stderr
    for command in ("embed", "serve", "parity", "bench"):
        assert re.search(rf"^\s+{command}\s+\w", r.stdout, re.M), r.stdout
    r = _python(code, "--version")
    assert r.returncode == 0 and r.stdout.strip() == f"pipepool {pipepool.__version__}"
    for command in ("embed", "serve"):  # their own --help too: torch waits for run()
        r = _python(code, command, "--help")
        assert r.returncode == 0 and "--long-inputs" in r.stdout, r.stderr


def test_serve_without_the_server_extras_says_what_to_install():
    code = (
        "import sys\n"
        "sys.modules['uvicorn'] = None  # as if the extras were not installed\n"
        "from pipepool.cli import main\n"
        "sys.exit(main(['serve']))\n"
    )
    r = _python(code)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "pipepool serve: needs the server extras (uvicorn is not installed): "
        "pip install 'pipepool[server]'"
    ]


def test_base_install_is_lean():
    base = [
        re.split(r"[<>=!~; \[]", req, maxsplit=1)[0].lower().replace("_", "-")
        for req in importlib.metadata.requires("pipepool") or []
        if "extra ==" not in req
    ]
    assert set(base) == {"torch", "tokenizers", "safetensors", "numpy", "tqdm", "huggingface-hub"}
