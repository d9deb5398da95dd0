"""A front end's batch calls on threads of its own (``intake.batch_threads``): the same
encodings as the Rust tokenizer's pool gives, a large batch split over the threads in order, a
small one on the calling thread; the process's switch set only where the user chose nothing,
and kept out of the tokenizer helpers it starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from itertools import pairwise

import pytest
from tiny_models import SENTENCES, long_prompts

from pipepool.intake.batch_threads import BatchThreads, item_chars
from pipepool.intake.tokenizer import Tokenizer

TEXTS = [*SENTENCES, *long_prompts()] * 8


@pytest.fixture(scope="module")
def tokenizer(minilm_path) -> Tokenizer:
    return Tokenizer(minilm_path / "tokenizer.json")


def _ids(encodings) -> list[list[int]]:
    return [e.ids for e in encodings]


def test_a_large_batch_split_over_the_threads_gives_the_pools_encodings(tokenizer):
    backend = tokenizer.backend
    threads = BatchThreads(4, split_chars=256)
    try:
        assert len(threads._parts(TEXTS)) - 1 == 4  # four parts: the split is exercised
        split = threads.run(backend.encode_batch_fast, TEXTS, add_special_tokens=True)
        pairs = list(zip(TEXTS, reversed(TEXTS), strict=True))
        split_pairs = threads.run(backend.encode_batch, pairs, add_special_tokens=True)
    finally:
        threads.close()
    assert _ids(split) == _ids(backend.encode_batch_fast(TEXTS, add_special_tokens=True))
    whole_pairs = backend.encode_batch(pairs, add_special_tokens=True)
    assert _ids(split_pairs) == _ids(whole_pairs)
    assert [p.type_ids for p in split_pairs] == [p.type_ids for p in whole_pairs]
    assert [p.offsets for p in split_pairs] == [p.offsets for p in whole_pairs]


def test_parts_are_consecutive_about_equal_and_never_below_the_split_size():
    threads = BatchThreads(8, split_chars=100)
    items = ["x" * n for n in (10, 300, 5, 5, 120, 80, 40, 200, 60, 30)]  # 850 characters
    bounds = threads._parts(items)
    assert bounds[0] == 0 and bounds[-1] == len(items)
    assert bounds == sorted(set(bounds))  # every part holds an item
    sizes = [sum(map(item_chars, items[a:b])) for a, b in pairwise(bounds)]
    assert len(sizes) <= 850 // 100
    assert min(sizes[:-1]) >= 850 / 8  # the last part takes what is left
    assert threads._parts(items[:3]) == [0, 2, 3]  # 315: 310 reach a third, 5 are left
    assert BatchThreads(8, split_chars=1000)._parts(items) == [0, len(items)]
    assert BatchThreads(1, split_chars=1)._parts(items) == [0, len(items)]


def test_a_small_batch_stays_on_the_calling_thread_and_a_large_one_spreads():
    seen: list[tuple[int, int]] = []
    lock = threading.Lock()
    started = threading.Barrier(3, timeout=30)  # three parts at once: three threads

    def encode(items: list, **_kw) -> list:
        with lock:
            seen.append((threading.get_ident(), len(items)))
        if len(items) < 30:
            started.wait()
        return list(items)

    threads = BatchThreads(3, split_chars=50)
    try:
        assert threads.run(encode, ["ab"] * 40) == ["ab"] * 40  # 80 characters: one part
        assert seen == [(threading.get_ident(), 40)]
        seen.clear()
        items = [f"{i:04d}" for i in range(60)]  # 240 characters: three parts of 80
        assert threads.run(encode, items) == items
    finally:
        threads.close()
    assert sorted(n for _, n in seen) == [20, 20, 20]
    assert len({ident for ident, _ in seen}) == 3
    assert threading.get_ident() in {ident for ident, _ in seen}


def test_a_parts_error_is_raised_to_the_caller():
    def encode(items: list, **_kw) -> list:
        if items[0] == "bad":
            raise ValueError("a part failed")
        return list(items)

    threads = BatchThreads(2, split_chars=10)
    try:
        with pytest.raises(ValueError, match="a part failed"):
            threads.run(encode, ["good" * 5] * 3 + ["bad", "bad" * 6])
    finally:
        threads.close()


_IN_A_FRESH_PROCESS = """
import json, os, sys
from pipepool.intake import batch_threads
from pipepool.intake.tokenizer import Tokenizer
from pipepool.intake.tokenizer_process import TokenizerProcess
from tiny_models import SENTENCES, long_prompts

texts = [*SENTENCES, *long_prompts()] * 40
tok = Tokenizer(__import__("pathlib").Path(sys.argv[1]))
on = batch_threads.use_own_threads(4)
ids, lengths = tok.encode_flat(texts)
helper = TokenizerProcess(tok.file, threads=2)
with open(f"/proc/{helper.pid}/environ", "rb") as f:
    helper_env = dict(v.split(b"=", 1) for v in f.read().split(b"\\0") if b"=" in v)
helper.close()
print(json.dumps({
    "on": on, "own": batch_threads._own is not None,
    "switch": os.environ.get("TOKENIZERS_PARALLELISM"),
    "helper": (helper_env.get(b"TOKENIZERS_PARALLELISM") or b"").decode(),
    "helper_ours": (helper_env.get(b"PIPEPOOL_OWN_TOKENIZER_THREADS") or b"").decode(),
    "helper_rayon": (helper_env.get(b"RAYON_NUM_THREADS") or b"").decode(),
    "ids": ids.tolist(), "lengths": lengths.tolist(),
}))
"""


def _fresh(minilm_path, **env: str) -> dict:
    chosen = ("TOKENIZERS_PARALLELISM", "RAYON_NUM_THREADS", "PIPEPOOL_OWN_TOKENIZER_THREADS")
    clean = {k: v for k, v in os.environ.items() if k not in chosen}
    tests = os.path.dirname(__file__)
    clean["PYTHONPATH"] = os.pathsep.join([tests, *sys.path])
    done = subprocess.run(
        [sys.executable, "-c", _IN_A_FRESH_PROCESS, str(minilm_path / "tokenizer.json")],
        env={**clean, **env}, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_front_end_process_switches_the_pool_off_but_not_its_helpers(tokenizer, minilm_path):
    got = _fresh(minilm_path)
    assert got["on"] and got["own"] and got["switch"] == "false"
    assert got["helper"] == "" and got["helper_ours"] == ""  # the helper keeps the Rust pool
    assert got["helper_rayon"] == "2"
    ids, lengths = tokenizer.encode_flat([*SENTENCES, *long_prompts()] * 40)
    assert got["ids"] == ids.tolist() and got["lengths"] == lengths.tolist()


@pytest.mark.parametrize("variable", ["TOKENIZERS_PARALLELISM", "RAYON_NUM_THREADS"])
def test_a_users_own_choice_of_the_pool_is_left_alone(minilm_path, variable):
    got = _fresh(minilm_path, **{variable: "1"})
    assert not got["on"] and not got["own"]
    assert got["switch"] == ("1" if variable == "TOKENIZERS_PARALLELISM" else None)


def test_a_front_end_started_by_a_front_end_turns_its_own_threads_on_too(minilm_path):
    """Another front end inherits the switch with pipepool's mark on it: not the user's."""
    got = _fresh(minilm_path, TOKENIZERS_PARALLELISM="false", PIPEPOOL_OWN_TOKENIZER_THREADS="1")
    assert got["on"] and got["own"] and got["switch"] == "false"
    assert got["helper"] == "" and got["helper_ours"] == ""
