"""Issue 2 acceptance: bad input gets a clear exception naming the problem, before anything is
queued, and the engine keeps serving afterwards."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import cosine, long_prompts

import pipepool
from pipepool.intake.inputs import FIRST_SLICE_IDS, MAX_CHARS_PER_TOKEN

MAX_LEN = 32
LONG = long_prompts()[3]  # hundreds of tokens with any tiny tokenizer


@pytest.fixture(scope="module")
def qwen3_engine(qwen3_path, engine_kind):
    with pipepool.Engine(
        str(qwen3_path), max_model_len=MAX_LEN, max_num_batched_tokens=16, **engine_kind
    ) as engine:
        yield engine


@pytest.fixture(scope="module")
def bert_engine(bert_path):
    with pipepool.Engine(str(bert_path), max_num_batched_tokens=64) as engine:
        yield engine


@pytest.fixture(scope="module")
def st_engine(st_bert_path):
    with pipepool.Engine(str(st_bert_path)) as engine:
        yield engine


def assert_still_serves(engine) -> None:
    """A bad request must not disturb the engine: a normal one right after still works."""
    assert engine.health in ("ok", "degraded")
    vectors = engine.embed(["a normal sentence after the error", "and another one"])
    assert vectors.shape[0] == 2 and np.isfinite(vectors).all()


# -- inputs -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ("", "input 0 is an empty string"),
        (["fine", ""], "input 1 is an empty string"),
        ([[]], "input 0 is an empty token list"),
        ([[5, 99999, 7]], "token id 99999 at position 1, outside the vocabulary"),
        ([[5, 6], [-1, 7]], "input 1 has token id -1 at position 0, outside the vocabulary"),
        (["text", [1, 2, 3]], "all strings or all lists of token ids"),
        ([[1, 2], "text"], "all strings or all lists of token ids"),
        ([[1.5, 2.0]], "all strings or all lists of token ids"),
        ([[5, 6], [7, True]], "input 1 is not a flat list of integer token ids"),
        ([[5, 6], ["7"]], "input 1 is not a flat list of integer token ids"),
        ([[[1, 2]]], "all strings or all lists of token ids"),
        (None, "inputs must be a list of strings or of token-id lists, got NoneType"),
        (42, "got int"),
    ],
)
def test_bad_inputs_raise_invalid_input_and_engine_keeps_serving(qwen3_engine, inputs, message):
    with pytest.raises(pipepool.InvalidInputError, match=message) as info:
        qwen3_engine.embed(inputs)
    assert info.value.param == "input"
    assert_still_serves(qwen3_engine)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (np.array([1.5, 2.0]), "input 1100 is not a flat list of integer token ids"),
        (np.array([True, False]), "input 1100 is not a flat list of integer token ids"),
        (np.array([[5, 6]]), "input 1100 is not a flat list of integer token ids"),
        (np.array([], dtype=np.int64), "input 1100 is an empty token list"),
        (np.array([5, 10**9]), "input 1100 has token id 1000000000 at position 1"),
        (np.array([5, -3], dtype=np.int32), "input 1100 has token id -3 at position 1"),
    ],
)
def test_bad_array_after_the_first_slice_names_it_and_loses_no_request(qwen3_engine, bad, message):
    """Numpy inputs are checked a slice (``FIRST_SLICE_IDS`` inputs, then more) at a time, so a bad
    one past the first slice is found after that slice went to the engine: the call still
    fails naming it, what was enqueued is cancelled, and every request of the next call is
    answered."""
    rng = np.random.default_rng(0)
    good = [rng.integers(5, 500, size=3) for _ in range(1200)]
    finished = qwen3_engine.stats.requests_finished + qwen3_engine.stats.requests_aborted
    submitted = qwen3_engine.stats.requests_submitted
    with pytest.raises(pipepool.InvalidInputError, match=message) as info:
        qwen3_engine.embed([*good[:1100], bad, *good[1100:]])
    assert info.value.index == 1100
    expected = qwen3_engine.embed(good[:4])
    assert np.allclose(qwen3_engine.embed([good[i] for i in range(4)]), expected)
    stats = qwen3_engine.stats
    # The first slice's requests were finished or aborted, none left pending.
    sent = stats.requests_submitted - submitted - 8
    assert FIRST_SLICE_IDS < 1100 and sent in (0, FIRST_SLICE_IDS)
    assert stats.requests_finished + stats.requests_aborted - finished == sent + 8
    assert_still_serves(qwen3_engine)


def test_token_id_equal_to_vocab_size_is_out_of_vocabulary(qwen3_engine):
    vocab = qwen3_engine.pipeline.deployment.vocab_size
    assert qwen3_engine.embed([[0, vocab - 1]]).shape == (1, 64)
    with pytest.raises(
        pipepool.InvalidInputError,
        match=rf"token id {vocab} .* outside the vocabulary \[0, {vocab}\)",
    ):
        qwen3_engine.embed([[0, vocab]])
    assert_still_serves(qwen3_engine)


def test_bad_input_in_a_batch_queues_nothing(qwen3_engine):
    submitted = qwen3_engine.stats.requests_submitted
    with pytest.raises(pipepool.InvalidInputError, match="input 2"):
        qwen3_engine.embed(["ok", "fine", ""])
    assert qwen3_engine.stats.requests_submitted == submitted
    assert_still_serves(qwen3_engine)


def test_prompt_over_max_model_len_is_rejected_with_its_length(qwen3_engine):
    n = len(qwen3_engine.tokenizer.encode_batch([LONG])[0])
    assert n > MAX_LEN
    with pytest.raises(
        pipepool.PromptTooLongError, match=f"input 1 has {n} tokens.*{MAX_LEN}.*--long-inputs"
    ) as info:
        qwen3_engine.embed(["short", LONG], long_inputs="error")
    assert info.value.index == 1
    assert_still_serves(qwen3_engine)
    with pytest.raises(pipepool.PromptTooLongError, match="max_model_len=32"):
        qwen3_engine.embed([list(range(MAX_LEN + 1))], long_inputs="error")
    assert_still_serves(qwen3_engine)
    # Exactly max_model_len tokens is fine.
    assert qwen3_engine.embed([list(range(MAX_LEN))]).shape == (1, 64)


def test_truncate_prompt_tokens_keeps_first_or_last_tokens(qwen3_engine, reference, qwen3_path):
    ref = reference(qwen3_path)
    full = ref.token_ids(LONG)
    eos = full[-1]  # the tiny Qwen3 tokenizer appends <|endoftext|>, like the real one
    right = qwen3_engine.tokenize([LONG], truncate_prompt_tokens=MAX_LEN)[0].tolist()
    left = qwen3_engine.tokenize([LONG], truncate_prompt_tokens=MAX_LEN, truncation_side="left")[
        0
    ].tolist()
    assert right == [*full[: MAX_LEN - 1], eos]
    assert left == full[-MAX_LEN:]
    # -1 means max_model_len.
    assert qwen3_engine.tokenize([LONG], truncate_prompt_tokens=-1)[0].tolist() == right

    vectors = qwen3_engine.embed([LONG, LONG], truncate_prompt_tokens=MAX_LEN, normalize=False)
    assert cosine(vectors[0], ref.pooled(right, "last")) >= 0.99999
    left_vec = qwen3_engine.embed(
        [LONG], truncate_prompt_tokens=MAX_LEN, truncation_side="left", normalize=False
    )
    assert cosine(left_vec[0], ref.pooled(left, "last")) >= 0.99999

    # Token ids are cut the same way (no special tokens to keep).
    ids = list(range(3, 3 + 50))
    out = qwen3_engine.tokenize([ids], truncate_prompt_tokens=10, truncation_side="left")[0]
    assert out.tolist() == ids[-10:]
    assert qwen3_engine.tokenize([ids], truncate_prompt_tokens=10)[0].tolist() == ids[:10]


@pytest.mark.parametrize(
    ("inputs", "bad", "where"),
    [
        (["fine", "bad \ud800 text"], 1, "character 4 is U+D800"),
        (["\udfff"], 0, "character 0 is U+DFFF"),
        ("caf\u00e9 then \ud83d alone", 0, "character 10 is U+D83D"),
    ],
)
def test_lone_surrogate_is_invalid_input_naming_input_and_character(
    qwen3_engine, inputs, bad, where
):
    """JSON's "\\ud800" escape decodes to a lone surrogate, which UTF-8 cannot encode and no
    tokenizer takes (it used to surface as a bare TypeError from the tokenizer)."""
    for call in (qwen3_engine.embed, qwen3_engine.tokenize):
        with pytest.raises(
            pipepool.InvalidInputError, match=f"input {bad} .*{re.escape(where)}"
        ) as info:
            call(inputs)
        assert info.value.param == "input"
    assert_still_serves(qwen3_engine)
    # A proper surrogate pair (one astral character) is fine.
    assert qwen3_engine.embed(["emoji \U0001f600 ok"]).shape == (1, 64)


def test_text_over_the_character_bound_is_refused_before_tokenisation(qwen3_engine, monkeypatch):
    bound = MAX_LEN * MAX_CHARS_PER_TOKEN
    huge = "word " * 2_000_000  # 10 MB: seconds of tokenising, were it tokenised
    tokenizer = qwen3_engine.tokenizer
    seen = []  # the longest text the tokenizer was given, per call
    encode_flat = tokenizer.encode_flat

    def recording(texts, **kwargs):
        seen.append(max(map(len, texts), default=0))
        return encode_flat(texts, **kwargs)

    monkeypatch.setattr(tokenizer, "encode_flat", recording)
    with pytest.raises(
        pipepool.PromptTooLongError, match=f"input 1 has 10000000 characters.*{bound}"
    ):
        qwen3_engine.embed(["short", huge], long_inputs="error")
    assert seen == []  # refused before any text of the call reached the tokenizer
    assert_still_serves(qwen3_engine)
    # At the bound itself the text is tokenised (and then over max_model_len in tokens).
    with pytest.raises(pipepool.PromptTooLongError, match="tokens, more than max_model_len"):
        qwen3_engine.embed([("x " * bound)[:bound]], long_inputs="error")
    # Truncating (the default) cuts it to the bound, then to max_model_len tokens.
    seen.clear()
    assert qwen3_engine.embed(["short", huge]).shape[0] == 2
    assert seen and max(seen) <= bound


@pytest.mark.parametrize("side", ["right", "left"])
def test_truncating_a_huge_text_equals_truncating_its_tokens(qwen3_engine, side):
    """With truncation asked for, a text over the character bound is cut to the bound before
    tokenising: the kept tokens lie far inside the cut, so they are those of the whole text."""
    huge = " ".join(f"w{i % 997}" for i in range(400_000))  # ~2.4 M characters
    assert len(huge) > MAX_LEN * MAX_CHARS_PER_TOKEN
    ids = qwen3_engine.tokenizer.encode_batch(
        [huge], max_tokens=MAX_LEN, keep="first" if side == "right" else "last"
    )[0]
    got = qwen3_engine.tokenize([huge], truncate_prompt_tokens=MAX_LEN, truncation_side=side)
    assert got[0].tolist() == ids.tolist()
    from_text = qwen3_engine.embed([huge], truncate_prompt_tokens=MAX_LEN, truncation_side=side)
    assert np.array_equal(from_text, qwen3_engine.embed([ids.tolist()]))


def test_flat_token_id_list_is_one_input_as_in_the_http_api(qwen3_engine):
    ids = [5, 17, 99, 3]
    expected = qwen3_engine.embed([ids])
    for one in (ids, np.array(ids), np.array(ids, dtype=np.int32)):
        got = qwen3_engine.embed(one)
        assert got.shape == (1, 64)
        assert np.array_equal(got, expected)
    assert [t.tolist() for t in qwen3_engine.tokenize(ids)] == [ids]
    with pytest.raises(pipepool.InvalidInputError, match="all strings or all lists of token ids"):
        qwen3_engine.embed([True, False])  # booleans are not token ids


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(truncate_prompt_tokens=MAX_LEN + 1), "larger than max_model_len=32"),
        (dict(truncate_prompt_tokens=0), "positive integer or -1"),
        (dict(truncate_prompt_tokens=-2), "positive integer or -1"),
        (dict(truncation_side="middle"), "truncation_side must be 'right' or 'left'"),
        (dict(dimensions=65), "dimensions=65 is larger than the model's embedding size 64"),
        (dict(dimensions=0), "dimensions must be a positive integer"),
        (dict(prompt_name="query"), "unknown prompt_name 'query' \\(this model has: none\\)"),
    ],
)
def test_bad_options_raise_invalid_input_and_engine_keeps_serving(qwen3_engine, kwargs, message):
    with pytest.raises(pipepool.InvalidInputError, match=message) as info:
        qwen3_engine.embed(["some text"], **kwargs)
    assert info.value.param == next(iter(kwargs))
    assert_still_serves(qwen3_engine)


def test_truncating_text_keeps_bert_cls_and_sep(bert_engine, reference, bert_path):
    ref = reference(bert_path)
    full = ref.token_ids(LONG * 2)
    assert len(full) > 512
    with pytest.raises(pipepool.PromptTooLongError, match="max_model_len=512"):
        bert_engine.embed([LONG * 2], long_inputs="error")
    assert_still_serves(bert_engine)
    cls, sep = full[0], full[-1]
    right = bert_engine.tokenize([LONG * 2], truncate_prompt_tokens=20)[0].tolist()
    left = bert_engine.tokenize([LONG * 2], truncate_prompt_tokens=20, truncation_side="left")[
        0
    ].tolist()
    assert right == [cls, *full[1:19], sep]
    assert left == [cls, *full[-19:-1], sep]
    vectors = bert_engine.embed([LONG * 2], truncate_prompt_tokens=-1, normalize=False)
    expected = ref.pooled([cls, *full[1:511], sep], "cls")
    assert cosine(vectors[0], expected) >= 0.99999


def test_unknown_prompt_name_lists_the_model_prompts(st_engine):
    with pytest.raises(pipepool.InvalidInputError, match=r"unknown prompt_name 'qeury'.*query"):
        st_engine.embed(["hello"], prompt_name="qeury")
    assert_still_serves(st_engine)
    with pytest.raises(pipepool.InvalidInputError, match="prompt_name applies to text inputs"):
        st_engine.embed([[101, 7592, 102]], prompt_name="query")
    assert_still_serves(st_engine)


def test_dimensions_limit_is_the_dense_head_output(st_engine):
    assert st_engine.embed(["hello"], dimensions=32).shape == (1, 32)
    with pytest.raises(pipepool.InvalidInputError, match=r"dimensions=33 is larger .* size 32"):
        st_engine.embed(["hello"], dimensions=33)
    assert_still_serves(st_engine)


# -- model folders ------------------------------------------------------------------------


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_config(folder, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def _rewrite_weights(folder, edit) -> None:
    file = folder / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_unknown_architecture_is_a_model_load_error(tmp_path, qwen3_path, qwen3_engine):
    folder = _copy(qwen3_path, tmp_path / "m")
    _edit_config(folder, architectures=["FancyNewForCausalLM"])
    with pytest.raises(pipepool.ModelLoadError, match="unknown architecture 'FancyNewForCausalLM'"):
        pipepool.Engine(str(folder))
    assert_still_serves(qwen3_engine)


def test_missing_weight_is_named(tmp_path, qwen3_path):
    folder = _copy(qwen3_path, tmp_path / "m")
    _rewrite_weights(folder, lambda t: t.pop("model.layers.2.mlp.up_proj.weight"))
    with pytest.raises(
        pipepool.ModelLoadError, match=r"missing weights: layers\.2\.mlp\.up_proj\.weight"
    ):
        pipepool.Engine(str(folder))


def test_truncated_weights_file_is_a_model_load_error_naming_it(tmp_path, bert_path):
    folder = _copy(bert_path, tmp_path / "m")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(pipepool.ModelLoadError, match=r"cannot read .*model\.safetensors"):
        pipepool.Engine(str(folder))


def test_unexpected_weight_is_named(tmp_path, bert_path):
    folder = _copy(bert_path, tmp_path / "m")
    _rewrite_weights(folder, lambda t: t.update({"encoder.layer.9.extra.weight": torch.ones(3)}))
    with pytest.raises(
        pipepool.ModelLoadError, match=r"unexpected weights: encoder\.layer\.9\.extra\.weight"
    ):
        pipepool.Engine(str(folder))


def test_shape_mismatch_is_named(tmp_path, qwen3_path):
    folder = _copy(qwen3_path, tmp_path / "m")
    name = "model.layers.0.self_attn.q_proj.weight"
    _rewrite_weights(folder, lambda t: t.update({name: t[name][:32].clone()}))
    with pytest.raises(
        pipepool.ModelLoadError,
        match=r"shape mismatch: layers\.0\.self_attn\.q_proj\.weight: checkpoint \(32, 64\), "
        r"model \(64, 64\)",
    ):
        pipepool.Engine(str(folder))


def test_config_and_checkpoint_that_disagree_on_layers_are_rejected(tmp_path, qwen3_path):
    folder = _copy(qwen3_path, tmp_path / "m")
    _edit_config(folder, num_hidden_layers=3)
    with pytest.raises(pipepool.ModelLoadError, match=r"unexpected weights: layers\.3\."):
        pipepool.Engine(str(folder))


def test_folder_without_config_or_weights_is_a_model_load_error(tmp_path, qwen3_path):
    folder = _copy(qwen3_path, tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(pipepool.ModelLoadError, match="holds no weights"):
        pipepool.Engine(str(folder))
    (folder / "config.json").unlink()
    with pytest.raises(pipepool.ModelLoadError, match=r"has no config\.json"):
        pipepool.Engine(str(folder))
