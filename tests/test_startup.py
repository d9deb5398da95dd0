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
        _NO_TORCH
        + "import pipepool\nfrom pipepool.commands.cli import main\nsys.exit(main(sys.argv[1:]))"
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
        "from pipepool.commands.cli import main\n"
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


_FAKE_TORCH_START = """
import sys
import pipepool  # decides before anything imports torch
import torch
print(sys.pycache_prefix)
print(torch.__spec__.cached)
"""


def test_bytecode_of_a_torch_installed_without_it_is_kept_in_the_user_cache(tmp_path):
    """Issue 10 item 5: torch installed without bytecode (PYTHONDONTWRITEBYTECODE, read-only
    site-packages) compiles its source at every start; pipepool keeps that bytecode in the
    user's cache directory instead, and leaves the install's folders alone."""
    site = tmp_path / "site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text("from . import ops\n")
    (site / "torch" / "ops.py").write_text("X = 1\n")
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIPEPOOL_", "PYTHONPY"))}
    src = str(Path(pipepool.__file__).parents[1])
    env.update(PYTHONPATH=f"{site}{os.pathsep}{src}", PYTHONDONTWRITEBYTECODE="1",
               PIPEPOOL_CACHE_DIR=str(cache))  # fmt: skip

    def start(**extra: str) -> list[str]:
        r = subprocess.run([sys.executable, "-c", _FAKE_TORCH_START], capture_output=True,
                           text=True, env={**env, **extra}, timeout=120)  # fmt: skip
        assert r.returncode == 0, r.stderr
        return r.stdout.split()

    assert start(PIPEPOOL_BYTECODE_CACHE="0")[0] == "None"  # the opt-out
    assert not list(cache.rglob("*.pyc"))
    prefix, cached = start()
    assert prefix == str(cache / "pycache")
    assert Path(cached).is_file() and Path(cached).is_relative_to(cache)  # written there...
    assert (Path(cached).parent / Path(cached).name.replace("__init__", "ops")).is_file()
    assert not (site / "torch" / "__pycache__").exists()  # ...and not next to the sources
    mtime = Path(cached).stat().st_mtime_ns
    assert start() == [prefix, cached] and Path(cached).stat().st_mtime_ns == mtime  # reused


def test_a_torch_with_its_bytecode_is_left_alone():
    r = _python("import sys, pipepool\nprint(sys.pycache_prefix)")
    assert r.returncode == 0 and r.stdout.strip() == "None", r.stderr
