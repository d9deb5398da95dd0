"""Issue 38 item 4 (and issue 15 item 7): ``pipepool.SentenceTransformer``, an adapter over the
Engine, offers ``SentenceTransformer``'s surface with its semantics. One script of calls runs
through ``sentence_transformers.SentenceTransformer`` and through ours on the same folder, and
every result is compared: the same container types (tensors where it gives tensors, NumPy where
NumPy), dtypes and shapes, vectors at cos >= 0.99999, quantized arrays equal (ours with
``ranges="call"``, sentence-transformers' per-call rule, which ours names where the model's
fixed scale is its default). Each engine kind runs the whole script."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from tiny_models import MIN_COSINE, SENTENCES, cosine, minilm_path

import pipepool
from pipepool.api.calibration_texts import CALIBRATION_TEXTS
from pipepool.api.int8_scale import symmetric_bound
from pipepool.api.quantization import quantize_symmetric

TEXTS = SENTENCES[:6]
LONG = " ".join(SENTENCES)  # far more than 256 tokens: truncated at max_seq_length
MIXED = ["", TEXTS[0], LONG, "  padded  ", TEXTS[1]]


@pytest.fixture(scope="module")
def st_model(st_bert_path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(st_bert_path), device="cpu")


@pytest.fixture(scope="module")
def ours(st_bert_path, engine_kind):
    """pipepool's SentenceTransformer, with an Engine of each kind it builds and owns."""
    with pipepool.SentenceTransformer(str(st_bert_path), **engine_kind) as model:
        yield model


def per_call(model: Any) -> dict:
    """The option that selects sentence-transformers' int8/uint8 rule on the Engine (its default
    is the model's fixed scale, ``api/int8_scale.py``); nothing for SentenceTransformer."""
    return {"ranges": "call"} if isinstance(model, pipepool.SentenceTransformer) else {}


# The script: each call as a function of the model (SentenceTransformer or Engine).
SCRIPT: dict[str, Callable[[Any], Any]] = {
    "encode": lambda m: m.encode(TEXTS),
    "encode one string": lambda m: m.encode(TEXTS[0]),
    "encode a tuple": lambda m: m.encode(tuple(TEXTS)),
    "encode a string array": lambda m: m.encode(np.array(TEXTS)),
    "empty, long and padded texts": lambda m: m.encode(MIXED),
    "one empty string": lambda m: m.encode(""),
    "prompt_name query": lambda m: m.encode(TEXTS, prompt_name="query"),
    "prompt_name passage": lambda m: m.encode(TEXTS, prompt_name="passage"),
    "prompt_name document": lambda m: m.encode(TEXTS, prompt_name="document"),
    "prompt": lambda m: m.encode(TEXTS, prompt="Represent this: "),
    "prompt wins over prompt_name": lambda m: m.encode(TEXTS, prompt="x: ", prompt_name="query"),
    "device cpu": lambda m: m.encode(TEXTS, device="cpu"),
    "device torch cpu": lambda m: m.encode(TEXTS, device=torch.device("cpu")),
    "convert_to_tensor": lambda m: m.encode(TEXTS, convert_to_tensor=True),
    "convert_to_numpy False": lambda m: m.encode(TEXTS, convert_to_numpy=False),
    "one string to tensor": lambda m: m.encode(TEXTS[0], convert_to_tensor=True),
    "normalize_embeddings": lambda m: m.encode(TEXTS, normalize_embeddings=True),
    "truncate_dim": lambda m: m.encode(TEXTS, truncate_dim=16),
    "truncate_dim normalized": lambda m: m.encode(
        TEXTS, truncate_dim=16, normalize_embeddings=True
    ),
    "batch_size and progress bar": lambda m: m.encode(TEXTS, batch_size=2, show_progress_bar=True),
    "token_embeddings": lambda m: m.encode(MIXED, output_value="token_embeddings"),
    "token_embeddings one string": lambda m: m.encode(TEXTS[0], output_value="token_embeddings"),
    "int8": lambda m: m.encode(MIXED, precision="int8", **per_call(m)),
    "uint8": lambda m: m.encode(MIXED, precision="uint8", **per_call(m)),
    "binary": lambda m: m.encode(MIXED, precision="binary"),
    "ubinary": lambda m: m.encode(MIXED, precision="ubinary"),
    "int8 tensor": lambda m: m.encode(
        TEXTS, precision="int8", convert_to_tensor=True, **per_call(m)
    ),
    "ubinary list": lambda m: m.encode(TEXTS, precision="ubinary", convert_to_numpy=False),
    "int8 one string": lambda m: m.encode(TEXTS[0], precision="int8", **per_call(m)),
    "encode_query": lambda m: m.encode_query(TEXTS),
    "encode_query own prompt": lambda m: m.encode_query(TEXTS, prompt_name="passage"),
    "encode_document": lambda m: m.encode_document(TEXTS),
    "encode_document positional batch_size": lambda m: m.encode_document(TEXTS, None, None, 4),
    "legacy sentences=": lambda m: m.encode(sentences=TEXTS),
    "prompts": lambda m: m.prompts,
    "default_prompt_name": lambda m: m.default_prompt_name,
    "similarity_fn_name": lambda m: m.similarity_fn_name,
    "max_seq_length": lambda m: m.max_seq_length,
    "device": lambda m: m.device,
    "truncate_dim attribute": lambda m: m.truncate_dim,
    "get_embedding_dimension": lambda m: m.get_embedding_dimension(),
    "tokenizer": lambda m: m.tokenizer(MIXED)["input_ids"],
    "tokenizer model_max_length": lambda m: m.tokenizer.model_max_length,
}

# The float vectors sentence-transformers quantizes in the script's int8/uint8 calls.
FLOATS_OF: dict[str, Callable[[Any], Any]] = {
    "int8": lambda m: m.encode(MIXED),
    "uint8": lambda m: m.encode(MIXED),
    "int8 tensor": lambda m: m.encode(TEXTS),
    "int8 one string": lambda m: m.encode(TEXTS[0]),
}


@pytest.mark.parametrize("call", list(SCRIPT))
def test_script_matches_sentence_transformers(ours, st_model, call):
    floats = FLOATS_OF[call](st_model) if call in FLOATS_OF else None
    assert_same(SCRIPT[call](ours), SCRIPT[call](st_model), call, floats)


def assert_same(got: Any, want: Any, what: str, floats: np.ndarray | None = None) -> None:
    """Same container type, dtype and shape; float vectors at cos >= MIN_COSINE with equal
    norms; anything else equal. ``floats``: sentence-transformers' float vectors of which
    ``want`` is the int8/uint8 quantization (see ``assert_quantized_equal``)."""
    assert type(got) is type(want), f"{what}: {type(got).__name__} for {type(want).__name__}"
    if isinstance(want, (list, tuple)) and want and not isinstance(want[0], (int, str)):
        assert len(got) == len(want), what
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{what}[{i}]", None if floats is None else floats[i])
        return
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, what
        got, want = got.numpy(), want.numpy()
    if not isinstance(want, np.ndarray):
        assert got == want, what
        return
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.shape}/{got.dtype}"
    if want.dtype.kind != "f":
        assert_quantized_equal(got, want, floats)
        return
    assert cosine(got, want).min() >= MIN_COSINE, what
    np.testing.assert_allclose(
        np.linalg.norm(np.atleast_2d(got), axis=-1),
        np.linalg.norm(np.atleast_2d(want), axis=-1),
        rtol=1e-5,
        err_msg=what,
    )


def assert_quantized_equal(got: np.ndarray, want: np.ndarray, floats: np.ndarray | None) -> None:
    """Equal, except that an int8/uint8 value may sit one bucket over where sentence-transformers'
    own float value lies within float rounding (1e-3 of a bucket) of a bucket edge: the engine's
    vectors and its differ by float rounding (cos >= 0.99999), and ``floor`` sends a value that
    close to an edge either way. Nowhere else may they differ."""
    differ = got != want
    if not differ.any():
        return
    assert floats is not None, f"{int(differ.sum())} quantized values differ"
    starts = floats.min(axis=0)
    steps = (floats.max(axis=0) - starts) / 255
    steps = np.where(steps == 0, 1, steps)
    position = (floats - starts) / steps  # in buckets; an integer is an edge
    off_edge = np.abs(position - np.round(position)) > 1e-3
    assert not (differ & off_edge).any(), "a value away from any bucket edge differs"
    assert (np.abs(got.astype(int) - want.astype(int))[differ] == 1).all()


@pytest.mark.parametrize("precision", ["int8", "uint8"])
def test_quantized_token_embeddings_differ_only_at_bucket_edges(ours, st_model, precision):
    """Token embeddings share buckets over every token of the call, as there."""
    kwargs = {"output_value": "token_embeddings"}
    floats = np.concatenate([t.numpy() for t in st_model.encode(MIXED, **kwargs)])
    got = ours.encode(MIXED, precision=precision, ranges="call", **kwargs)
    want = st_model.encode(MIXED, precision=precision, **kwargs)
    assert [g.dtype for g in got] == [w.dtype for w in want]
    assert_quantized_equal(np.concatenate(got), np.concatenate(want), floats)


@pytest.mark.parametrize("precision", ["int8", "uint8"])
def test_int8_by_default_is_the_models_fixed_scale_on_every_engine_kind(ours, precision):
    """The engine's own default (``api/int8_scale.py``): one symmetric scale from the
    calibration texts, so a text's integers are the same alone and among others."""
    bound = symmetric_bound(ours.engine.embed(list(CALIBRATION_TEXTS)))
    got = ours.encode(MIXED, precision=precision)
    np.testing.assert_array_equal(got, quantize_symmetric(ours.encode(MIXED), precision, bound))
    alone = np.stack([ours.encode(text, precision=precision) for text in MIXED])
    np.testing.assert_array_equal(alone, got)


def test_similarity_matches_sentence_transformers_for_every_function(ours, st_model):
    a, b = st_model.encode(TEXTS[:3]), st_model.encode(TEXTS[3:])
    inputs = [(a, b), (a[0], b), (torch.from_numpy(a), list(b)), (a.astype(np.float16), b)]
    try:
        for name in ("cosine", "dot", "euclidean", "manhattan"):
            ours.similarity_fn_name = st_model.similarity_fn_name = name
            assert ours.similarity_fn_name == name
            for x, y in inputs:
                got, want = ours.similarity(x, y), st_model.similarity(x, y)
                assert isinstance(got, torch.Tensor) and got.dtype == want.dtype
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
            got, want = ours.similarity_pairwise(a, b), st_model.similarity_pairwise(a, b)
            assert isinstance(got, torch.Tensor) and got.shape == want.shape == (3,)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    finally:
        ours.similarity_fn_name = st_model.similarity_fn_name = "cosine"
    with pytest.raises(pipepool.InvalidInputError, match="similarity_fn_name must be one of"):
        ours.similarity_fn_name = "maxsim"


def test_max_seq_length_set_truncates_as_sentence_transformers(ours, st_model):
    try:
        ours.max_seq_length = st_model.max_seq_length = 8
        assert ours.tokenizer.model_max_length == 8
        assert_same(ours.encode(MIXED), st_model.encode(MIXED), "encode at 8 tokens")
        tokens = ours.encode(MIXED, output_value="token_embeddings")
        assert max(len(t) for t in tokens) == 8
    finally:
        ours.max_seq_length = st_model.max_seq_length = 256
    # The engine was sized for max_model_len: longer is refused, saying what to do.
    with pytest.raises(pipepool.InvalidInputError, match="started with max_model_len=256"):
        ours.max_seq_length = 512
    assert ours.max_seq_length == 256


def test_prompts_edited_by_the_caller_apply_as_in_sentence_transformers(ours, st_model):
    try:
        for model in (ours, st_model):
            model.prompts["title"] = "title: "
            model.default_prompt_name = "title"
        assert_same(ours.encode(TEXTS), st_model.encode(TEXTS), "default prompt")
        both = {"prompt_name": "query"}
        assert_same(ours.encode(TEXTS, **both), st_model.encode(TEXTS, **both), "named")
    finally:
        for model in (ours, st_model):
            model.default_prompt_name = None
            del model.prompts["title"]


def test_encode_one_string_gives_one_vector_and_empty_list_an_empty_array(ours, st_model):
    one = ours.encode(TEXTS[0])
    assert one.shape == st_model.encode(TEXTS[0]).shape == (32,)
    # A deliberate difference: sentence-transformers gives a [0] float64 array; a [0, dim]
    # float32 one stacks with other results.
    assert ours.encode([]).shape == (0, 32) and ours.encode([]).dtype == np.float32
    assert tuple(ours.encode([], convert_to_tensor=True).shape) == (0, 32)
    assert ours.encode([], precision="ubinary").shape == (0, 4)
    assert ours.encode([], convert_to_numpy=False) == []
    assert ours.encode([], output_value="token_embeddings") == []
    assert ours.engine.embed([]).shape == (0, 32)
    assert ours.engine.embed_tokens([]) == []
    assert ours.engine.submit([]).done()


def test_empty_string_is_its_special_tokens_on_the_st_surface_only(ours, st_model):
    assert ours.tokenizer("")["input_ids"] == [101, 102]  # [CLS] [SEP]
    assert cosine(ours.encode([""]), st_model.encode([""])).min() >= MIN_COSINE
    # The engine's own API still refuses an empty input, naming it.
    with pytest.raises(pipepool.InvalidInputError, match="input 1 is an empty string"):
        ours.engine.embed(["a", ""])


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"device": "cuda:0"}, "this engine runs on cpu"),
        ({"device": ["cpu", "cuda:1"]}, "cannot move to device='cuda:1'"),
        ({"device": "tpu-of-dreams"}, "is not a device name"),
        ({"pool": {"processes": []}}, "multi-process pool"),
        ({"precision": "float16"}, "precision must be one of"),
        ({"output_value": "logits"}, "output_value must be one of"),
        ({"output_value": None}, "output_value must be one of"),
        ({"prompt_name": "nope"}, "Prompt name 'nope' not found"),
        ({"batch_size": 0}, "batch_size must be a positive integer"),
        ({"foo": 1}, r"does not use: \['foo'\]"),
        ({"precision": "int8", "ranges": "batch"}, "ranges must be 'model', 'call' or"),
        ({"precision": "int8", "ranges": None}, "ranges must be 'model', 'call' or"),
        ({"precision": "binary", "ranges": "call"}, "precision 'binary' has none"),
        ({"ranges": np.zeros((2, 32))}, "precision 'float32' has none"),
    ],
)
def test_bad_encode_options_raise_value_errors_naming_the_problem(ours, kwargs, says):
    with pytest.raises(pipepool.InvalidInputError, match=says) as info:
        ours.encode(TEXTS, **kwargs)
    assert isinstance(info.value, ValueError)


def test_device_list_of_the_engines_own_devices_is_accepted(ours, st_model):
    assert_same(ours.encode(TEXTS, device=["cpu"]), st_model.encode(TEXTS), "device list")


# -- a folder that sets what the fixture leaves at the defaults ----------------------------------


@pytest.fixture(scope="module")
def st_manhattan_path(st_bert_path, tmp_path_factory):
    """The st_bert folder saying similarity_fn_name manhattan, a default prompt and a
    truncate_dim."""
    path = tmp_path_factory.mktemp("st") / "st-bert-manhattan"
    shutil.copytree(st_bert_path, path)
    config_file = path / "config_sentence_transformers.json"
    config = json.loads(config_file.read_text())
    config.update(similarity_fn_name="manhattan", default_prompt_name="query", truncate_dim=24)
    config_file.write_text(json.dumps(config))
    return path


def test_folder_settings_are_read_as_sentence_transformers_reads_them(st_manhattan_path):
    from sentence_transformers import SentenceTransformer

    st_model = SentenceTransformer(str(st_manhattan_path), device="cpu")
    with pipepool.SentenceTransformer(str(st_manhattan_path)) as ours:
        for call in ("similarity_fn_name", "default_prompt_name", "truncate_dim attribute",
                     "get_embedding_dimension", "prompts", "encode", "encode_document",
                     "prompt_name document", "token_embeddings"):  # fmt: skip
            assert_same(SCRIPT[call](ours), SCRIPT[call](st_model), call)
        a, b = ours.encode(TEXTS[:3]), ours.encode(TEXTS[3:])
        torch.testing.assert_close(ours.similarity(a, b), st_model.similarity(a, b))


def test_int8_of_minilm_is_sentence_transformers_quantization_of_the_engines_vectors():
    """The issue's case: 200 texts x 384 dimensions with all-MiniLM-L6-v2. With
    ``ranges="call"`` the engine quantizes exactly as ``quantize_embeddings`` does (buckets from
    the whole call's vectors); a value differs from sentence-transformers' own only where its
    float lies on a bucket edge."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.util.quantization import quantize_embeddings

    texts = [f"{i}: {SENTENCES[i % len(SENTENCES)]}" for i in range(200)]
    st_model = SentenceTransformer(str(minilm_path()), device="cpu")
    with pipepool.SentenceTransformer(str(minilm_path())) as ours:
        vectors = ours.encode(texts)
        for precision in ("int8", "uint8", "binary", "ubinary"):
            rule = {"ranges": "call"} if precision.endswith("int8") else {}
            got = ours.encode(texts, precision=precision, **rule)
            np.testing.assert_array_equal(got, quantize_embeddings(vectors, precision=precision))
        got = ours.encode(texts, precision="int8", ranges="call")
    assert got.shape == (200, 384)
    floats = st_model.encode(texts)
    assert_quantized_equal(got, st_model.encode(texts, precision="int8"), floats)


@pytest.mark.parametrize("name", ["bert", "qwen2", "qwen3"])
def test_plain_folder_embeds_as_sentence_transformers_builds_it(name, bert_path, decoder_paths):
    """A folder without sentence-transformers modules: SentenceTransformer builds mean pooling
    (the last token for a *ForCausalLM, as Qwen3's here; Qwen2Model is mean) and no Normalize,
    where the engine's own embed uses the family's pooling, normalized."""
    from sentence_transformers import SentenceTransformer

    path = bert_path if name == "bert" else decoder_paths[name]
    st_model = SentenceTransformer(str(path), device="cpu")
    if st_model.tokenizer.pad_token is None:  # its batches need one; the engine does not pad
        st_model.tokenizer.pad_token = st_model.tokenizer.eos_token or "<|endoftext|>"
    with pipepool.SentenceTransformer(str(path)) as ours:
        calls = ("encode", "empty, long and padded texts", "encode_query", "prompts",
                 "max_seq_length", "similarity_fn_name", "get_embedding_dimension")  # fmt: skip
        for call in calls:
            assert_same(SCRIPT[call](ours), SCRIPT[call](st_model), f"{name}: {call}")
