"""Issue 60 item 2: late chunking equals a by-hand transformers reference of its rule (the whole
document through the model once, each chunk the mean of the final hidden states of the tokens
that start inside it, then the model's normalisation), at PP 1 and 2 with a budget small enough
that a decoder's prompt is chunked; over-long documents by the macro-chunk rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import MIN_COSINE, SENTENCES, cosine

import pipepool
from pipepool.api.late_chunking import MAX_OVERLAP

CHUNKS = [
    SENTENCES[0],
    " ".join(SENTENCES[1:4]),
    "Berlin is the capital of Germany.",
    " ".join(SENTENCES[4:9]),
]


def _reference(path, chunks: list[str], *, normalize: bool = True) -> np.ndarray:
    """The rule computed with transformers on the joined document: tokens assigned to chunks by
    where they start (a chunk's span begins at the space before it), specials left out."""
    bounds, at = [], 0
    for i, chunk in enumerate(chunks):
        bounds.append((at - 1 if i else at, at + len(chunk)))
        at += len(chunk) + 1
    return _span_reference(path, " ".join(chunks), bounds, normalize=normalize)


def _span_reference(path, text: str, bounds, *, normalize: bool = True) -> np.ndarray:
    """Each span's mean final hidden state (tokens by where they start, specials left out)
    over one transformers pass of ``text``."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModel.from_pretrained(str(path), torch_dtype=torch.float32).eval()
    enc = tokenizer(
        text, return_offsets_mapping=True, return_special_tokens_mask=True, return_tensors="pt"
    )
    with torch.no_grad():
        states = model(
            input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]
        ).last_hidden_state[0]
    starts = [s for s, _ in enc["offset_mapping"][0].tolist()]
    special = enc["special_tokens_mask"][0].tolist()
    out = []
    for lo, hi in bounds:
        rows = [j for j, s in enumerate(starts) if not special[j] and lo <= s < hi]
        v = states[rows].mean(0).numpy()
        out.append(v / np.linalg.norm(v) if normalize else v)
    return np.stack(out)


@pytest.mark.parametrize("pp", [1, 2])
def test_an_encoders_chunks_equal_the_reference(minilm_path, pp):
    want = _reference(minilm_path, CHUNKS)
    with pipepool.Engine(
        str(minilm_path), pipeline_parallel_size=pp, max_num_batched_tokens=16
    ) as engine:
        got = engine.embed(CHUNKS, late_chunking=True)
        alone = engine.embed(CHUNKS)
    assert got.shape == (len(CHUNKS), 384)
    assert cosine(got, want).min() >= MIN_COSINE
    # context reaches every chunk: not what embedding each chunk alone gives
    assert cosine(got, alone).max() < 0.99


@pytest.mark.parametrize("pp", [1, 2])
def test_a_decoders_chunks_equal_the_reference_under_chunked_prefill(qwen3_path, pp):
    want = _reference(qwen3_path, CHUNKS)
    with pipepool.Engine(
        str(qwen3_path), pipeline_parallel_size=pp, max_num_batched_tokens=16
    ) as engine:
        got = engine.embed(CHUNKS, late_chunking=True)
        assert engine.stats.chunked_requests >= 1, "the document was not chunked"
    assert cosine(got, want).min() >= MIN_COSINE


def test_matryoshka_dimensions_and_normalize_apply_after_the_mean(minilm_path):
    raw = _reference(minilm_path, CHUNKS, normalize=False)
    with pipepool.Engine(str(minilm_path)) as engine:
        cut = engine.embed(CHUNKS, late_chunking=True, dimensions=64)
        unnormalized = engine.embed(CHUNKS, late_chunking=True, normalize=False)
    assert cut.shape == (len(CHUNKS), 64)
    assert np.allclose(np.linalg.norm(cut, axis=1), 1.0, atol=1e-5)
    assert cosine(cut, raw[:, :64]).min() >= MIN_COSINE
    assert np.allclose(unnormalized, raw, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_a_document_longer_than_the_context_follows_the_macro_chunk_rule(minilm_path):
    """30,000 tokens on a 512-token model (MiniLM's positions; its sentence-transformers
    folder says 256): each token's state from the earliest window of
    ``W`` content tokens (specials around each) that holds it, windows ``W - overlap`` apart."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(minilm_path))
    model = AutoModel.from_pretrained(str(minilm_path)).eval()
    chunks, tokens = [], 0
    while tokens < 30_000:
        chunk = " ".join(SENTENCES[(len(chunks) * 7 + k) % len(SENTENCES)] for k in range(12))
        chunks.append(chunk)
        tokens += len(tokenizer(chunk, add_special_tokens=False)["input_ids"])
    text = " ".join(chunks)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, starts = enc["input_ids"], [s for s, _ in enc["offset_mapping"]]
    assert len(ids) >= 30_000
    width = 512 - 2  # [CLS] ... [SEP]
    overlap = min(MAX_OVERLAP, width // 4)
    states = np.zeros((len(ids), 384), np.float32)
    done, start = 0, 0
    with torch.no_grad():
        while done < len(ids):
            window = ids[start : start + width]
            x = torch.tensor([[tokenizer.cls_token_id, *window, tokenizer.sep_token_id]])
            out = model(input_ids=x).last_hidden_state[0, 1:-1].numpy()
            end = start + len(window)
            states[done:end] = out[done - start :]
            done, start = end, start + width - overlap
    want, at = [], 0
    for i, chunk in enumerate(chunks):
        lo, hi = (at - 1 if i else at), at + len(chunk)
        rows = [j for j, s in enumerate(starts) if lo <= s < hi]
        v = states[rows].mean(0)
        want.append(v / np.linalg.norm(v))
        at += len(chunk) + 1
    with pipepool.Engine(str(minilm_path), max_model_len=512) as engine:
        got = engine.embed(chunks, late_chunking=True)
    assert got.shape == (len(chunks), 384)
    assert cosine(got, np.stack(want)).min() >= MIN_COSINE


def test_what_late_chunking_cannot_take_is_refused_by_name(minilm_path):
    with pipepool.Engine(str(minilm_path)) as engine:
        with pytest.raises(pipepool.InvalidInputError, match="chunk 1 has no tokens"):
            engine.embed(["a sentence", "   ", "another"], late_chunking=True)
        with pytest.raises(pipepool.InvalidInputError, match="list of strings"):
            engine.embed([[101, 102]], late_chunking=True)
        with pytest.raises(pipepool.InvalidInputError, match="truncate_prompt_tokens"):
            engine.embed(CHUNKS, late_chunking=True, truncate_prompt_tokens=8)
        with pytest.raises(pipepool.InvalidInputError, match="truncation_side"):
            engine.embed(CHUNKS, late_chunking=True, truncation_side="left")


def test_a_classifier_cannot_be_late_chunked(cross_encoder_path):
    with (
        pipepool.Engine(str(cross_encoder_path)) as engine,
        pytest.raises(pipepool.InvalidInputError, match="late_chunking is not supported"),
    ):
        engine.embed(CHUNKS, late_chunking=True)


# -- over HTTP: /v1/embeddings with Jina's late_chunking, and a batch line ------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from test_server import ServerProcess

    s = ServerProcess([], tmp_path_factory.mktemp("late-chunking") / "server.log")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def test_the_server_late_chunks_as_the_engine_does(server, minilm_path):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    answer = client.embeddings.create(
        model="all-MiniLM-L6-v2", input=CHUNKS, extra_body={"late_chunking": True}
    )
    got = np.array([d.embedding for d in answer.data])
    assert cosine(got, _reference(minilm_path, CHUNKS)).min() >= MIN_COSINE
    with pipepool.Engine(str(minilm_path)) as engine:
        alone = engine.embed(CHUNKS)
        ran = sum(len(t) for t in engine.tokenize([" ".join(CHUNKS)]))
    assert cosine(got, alone).max() < 0.99  # not each chunk embedded alone
    assert answer.usage.prompt_tokens == ran  # the document's tokens, its specials included


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"outputs": ["sparse"]}, "late_chunking"),
        ({"truncate_prompt_tokens": 8}, "late_chunking"),
        ({"truncation_side": "left"}, "truncation_side"),
        ({"add_special_tokens": False}, "add_special_tokens"),
    ],
)
def test_what_late_chunking_cannot_honour_is_a_400_naming_it(server, extra, param):
    import httpx

    body = {"input": CHUNKS, "late_chunking": True, **extra}
    r = httpx.post(server.url + "/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_a_batch_line_late_chunks_as_the_route_does(tmp_path, minilm_path):
    import json
    import subprocess
    import sys

    lines = [
        {"custom_id": "late", "method": "POST", "url": "/v1/embeddings",
         "body": {"input": CHUNKS, "late_chunking": True}},
        {"custom_id": "alone", "method": "POST", "url": "/v1/embeddings",
         "body": {"input": CHUNKS}},
    ]  # fmt: skip
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(x) + "\n" for x in lines))
    done = subprocess.run(
        [sys.executable, "-m", "pipepool", "run-batch", "-i", str(source), "-o", str(output)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    answers = {x["custom_id"]: x for x in map(json.loads, output.read_text().splitlines())}
    vectors = {
        k: np.array([d["embedding"] for d in v["response"]["body"]["data"]])
        for k, v in answers.items()
    }
    assert cosine(vectors["late"], _reference(minilm_path, CHUNKS)).min() >= MIN_COSINE
    assert cosine(vectors["late"], vectors["alone"]).max() < 0.99


# -- the command line: documents in, chunk vectors out ----------------------------------------


def test_embed_late_chunking_reads_separated_lines_and_jsonl_documents(tmp_path, minilm_path):
    import json

    from pipepool.commands.cli import main

    sep = " | "
    line = sep.join(CHUNKS[:3])
    (tmp_path / "docs.txt").write_text(line + "\n")
    spans_doc = {"text": "Hello world. A second part here.", "spans": [[0, 12], [13, 32]]}
    (tmp_path / "docs.jsonl").write_text(json.dumps(CHUNKS) + "\n" + json.dumps(spans_doc) + "\n")
    out_txt, out_jsonl = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    base = ["embed", "--model", str(minilm_path), "--late-chunking"]
    assert main([*base, "--chunk-separator", sep, "--input", str(tmp_path / "docs.txt"),
                 "--output", str(out_txt)]) == 0  # fmt: skip
    assert main([*base, "--input", str(tmp_path / "docs.jsonl"), "--output", str(out_jsonl)]) == 0

    rows = [json.loads(x) for x in out_txt.read_text().splitlines()]
    bounds, at = [], 0
    for piece in CHUNKS[:3]:  # each piece where it stands in the line; separators nobody's
        bounds.append((at, at + len(piece)))
        at += len(piece) + len(sep)
    assert [(r["document"], r["chunk"], r["start"], r["end"]) for r in rows] == [
        (0, c, lo, hi) for c, (lo, hi) in enumerate(bounds)
    ]
    want = _span_reference(minilm_path, line, bounds)
    assert cosine(np.array([r["embedding"] for r in rows]), want).min() >= MIN_COSINE

    rows = [json.loads(x) for x in out_jsonl.read_text().splitlines()]
    assert [(r["document"], r["chunk"]) for r in rows] == [(0, 0), (0, 1), (0, 2), (0, 3),
                                                           (1, 0), (1, 1)]  # fmt: skip
    got = np.array([r["embedding"] for r in rows])
    assert cosine(got[:4], _reference(minilm_path, CHUNKS)).min() >= MIN_COSINE
    want = _span_reference(minilm_path, spans_doc["text"], spans_doc["spans"])
    assert cosine(got[4:], want).min() >= MIN_COSINE


@pytest.mark.parametrize(
    "extra,says",
    [
        (["--chunk-separator", "|", "--truncate-prompt-tokens", "4", "a|b"],
         "--truncate-prompt-tokens does not apply"),
        (["a|b"], "needs --chunk-separator"),
        (["--chunk-separator", "|", "--output-type", "sparse", "a|b"],
         "--output-type does not apply"),
    ],
)  # fmt: skip
def test_embed_late_chunking_refuses_what_it_cannot_honour(minilm_path, capsys, extra, says):
    from pipepool.commands.cli import main

    assert main(["embed", "--model", str(minilm_path), "--late-chunking", *extra]) == 2
    assert says in capsys.readouterr().err


def test_spans_that_overlap_or_leave_the_text_are_refused():
    from pipepool.api.late_chunking import LateChunkedText

    with pytest.raises(pipepool.InvalidInputError, match="span 1"):
        LateChunkedText.from_spans("abcdef", [(0, 3), (2, 5)])
    with pytest.raises(pipepool.InvalidInputError, match="span 0"):
        LateChunkedText.from_spans("abc", [(0, 9)])
