"""pipepool.ray: EmbedBatches in Ray Data's actors gives the engine's own outputs, passes every
other column through in row order, names a bad row, and leaves no stage process behind.

One local Ray cluster of 2 CPUs for the module. Stage processes are found by a token in their
environment (set for every Ray worker through the job's runtime_env; a stage process inherits
its actor's), so stages of other programs on the host are never counted."""

from __future__ import annotations

import gc
import os
import random
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

import pandas as pd  # noqa: E402  (after the skip: ray[data] brings pandas and pyarrow)
import pyarrow as pa  # noqa: E402
import tiny_models  # noqa: E402
import tiny_retrieval  # noqa: E402
import tiny_towers  # noqa: E402
from ray.data.block import BlockAccessor  # noqa: E402

from pipepool import Engine, InvalidInputError  # noqa: E402
from pipepool.ray import EmbedBatches  # noqa: E402

# Slow: a Ray cluster started. Ray Data's own code warns about its deprecated settings when
# it prints its context.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data.context"),
]
MARKER = "PIPEPOOL_RAY_TEST_TOKEN"
WORDS = [
    *("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "pipeline"),
    *("stages", "hand", "hidden", "states", "to", "each", "other", "and", "ray", "actors"),
    *("embed", "rows", "of", "text", "into", "vectors", "for", "retrieval", "later"),
]
COS_MIN = 0.99999


def _texts(n: int, seed: int = 0) -> list[str]:
    """Varied lengths: 1-12 words, every 199th text long enough to be truncated (MiniLM keeps 256
    tokens)."""
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(300 if i % 199 == 5 else rng.randint(1, 12)))
        for i in range(n)
    ]


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def _stage_pids(token: str) -> set[int]:
    """Live stage processes (``pipepool.parallel.worker``) started under this module's cluster."""
    found: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"pipepool.parallel.worker" not in f.read():
                    continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                if f"{MARKER}={token}".encode() in f.read().split(b"\0"):
                    found.add(int(entry))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def _wait_gone(token: str, timeout: float = 30.0) -> set[int]:
    deadline = time.monotonic() + timeout
    while (left := _stage_pids(token)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster of 2 CPUs; yields the token its workers carry."""
    token = uuid.uuid4().hex
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {MARKER: token}},
    )
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True  # row order is part of what is tested
    context.enable_progress_bars = False
    yield token
    ray.shutdown()


@pytest.fixture(autouse=True)
def cluster_idle_before():
    """Each test starts with the cluster's CPUs free for its actors. The actor of a job that
    failed lives as long as references to the job do (the error's traceback; Ray Data's log
    records, which pytest keeps until that test's teardown is over), reference cycles that
    only the garbage collector frees: it runs here."""
    if ray.is_initialized():
        gc.collect()
        deadline = time.monotonic() + 60
        while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ray.available_resources().get("CPU", 0) >= 2, "an earlier test's actor lives on"


@pytest.fixture(scope="module")
def minilm() -> str:
    return str(tiny_models.minilm_path())


@pytest.fixture(scope="module")
def minilm_engine(minilm):
    with Engine(minilm) as engine:
        yield engine


def _numpy(dataset) -> dict[str, np.ndarray]:
    """The whole dataset as one numpy batch, in its order."""
    tables = list(dataset.iter_batches(batch_size=None, batch_format="pyarrow"))
    return BlockAccessor.for_block(pa.concat_tables(tables)).to_batch_format("numpy")


def _pool(size: int) -> ray.data.ActorPoolStrategy:
    return ray.data.ActorPoolStrategy(size=size)


def test_pipepool_does_not_import_ray_nor_pipepool_ray_torch():
    """``import pipepool`` stays free of Ray; a driver that only names EmbedBatches for
    map_batches does not pay torch's import (the actors do)."""
    code = (
        "import sys, pipepool; assert 'ray' not in sys.modules; "
        "import pipepool.ray; assert 'torch' not in sys.modules, 'torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- in this process: the callable without Ray's actors ----------------------------------------


@pytest.fixture(scope="module")
def local_embedder(minilm):
    embedder = EmbedBatches(minilm, output_column="vec")
    yield embedder
    embedder.close()


def test_every_batch_format_comes_back_as_one_arrow_table(local_embedder, minilm_engine):
    texts = _texts(5)
    expected = minilm_engine.embed(texts)
    ids = np.arange(10, 15)
    batches = {
        "numpy": {"id": ids, "text": np.array(texts, dtype=object)},
        "pandas": pd.DataFrame({"id": ids, "text": texts}),
        "pyarrow": pa.table({"id": ids, "text": texts}),
    }
    schemas = set()
    for batch in batches.values():
        table = local_embedder(batch)
        assert table.column_names == ["id", "text", "vec"]
        assert table.column("id").to_pylist() == ids.tolist()
        assert table.column("text").to_pylist() == texts
        vectors = BlockAccessor.for_block(table).to_batch_format("numpy")["vec"]
        assert vectors.shape == (5, 384) and vectors.dtype == np.float32
        assert _cosines(vectors, expected).min() >= COS_MIN
        schemas.add(str(table.schema.field("vec").type))
    assert len(schemas) == 1


def test_an_empty_batch_gives_empty_typed_columns(local_embedder):
    empty = pa.table({"id": pa.array([], pa.int64()), "text": pa.array([], pa.string())})
    table = local_embedder(empty)
    assert table.num_rows == 0
    full = local_embedder(pa.table({"id": [1], "text": ["one"]}))
    assert table.schema.field("vec").type == full.schema.field("vec").type


@pytest.mark.parametrize(
    ("text", "said"),
    [(None, "holds None, not a string"), (3, "holds 3, not a string"), ("", "empty string")],
)
def test_a_bad_text_names_its_row_and_id(local_embedder, text, said):
    batch = pd.DataFrame({"id": [41, 42, 43], "text": ["fine", text, "fine"]})
    with pytest.raises(InvalidInputError, match="row 1 of the batch") as caught:
        local_embedder(batch)
    assert "id=42" in str(caught.value) and said in str(caught.value)


def test_missing_and_taken_columns_are_named(local_embedder):
    with pytest.raises(InvalidInputError, match="no column 'text'; its columns are 'id', 'body'"):
        local_embedder({"id": np.arange(2), "body": np.array(["a", "b"], dtype=object)})
    with pytest.raises(InvalidInputError, match="already has column 'vec'"):
        local_embedder(pa.table({"text": ["a"], "vec": [1.0]}))


def test_outputs_the_model_lacks_are_refused_at_construction(minilm):
    with pytest.raises(InvalidInputError, match="does not give sparse"):
        EmbedBatches(minilm, output="sparse")
    with pytest.raises(InvalidInputError, match="output must be one of"):
        EmbedBatches(minilm, output="colbert")
    with pytest.raises(InvalidInputError, match="only dense, sparse, multi_vector"):
        EmbedBatches(minilm, output=["dense", "score"])


def test_call_options_token_embeddings_and_labels(local_embedder, bert_path, tmp_path):
    """Keyword arguments of a call reach the engine; token embeddings and a classifier's labels
    fill their columns with the engine's own outputs."""
    texts = _texts(6, seed=7)
    batch = pa.table({"id": range(6), "text": texts})
    table = local_embedder(batch, dimensions=128)  # what map_batches' fn_kwargs pass
    vectors = BlockAccessor.for_block(table).to_batch_format("numpy")["vec"]
    np.testing.assert_allclose(vectors, local_embedder.engine.embed(texts, dimensions=128))

    tokens = EmbedBatches(str(bert_path), output="token_embeddings")
    try:
        got = BlockAccessor.for_block(tokens(batch)).to_batch_format("numpy")["token_embeddings"]
        for row, want in zip(got, tokens.engine.embed_tokens(texts), strict=True):
            np.testing.assert_allclose(row, want)
    finally:
        tokens.close()

    cross_encoder = tiny_models.make_cross_encoder(tmp_path / "cross-encoder")
    classifier = EmbedBatches(str(cross_encoder), output="classify")
    try:
        got = BlockAccessor.for_block(classifier(batch)).to_batch_format("numpy")
        want = classifier.engine.classify(texts)
        assert got["label"].tolist() == want.labels
        np.testing.assert_allclose(got["label_probs"], want.probs)
        empty = classifier(batch.slice(0, 0))
        assert empty.column_names == ["id", "text", "label", "label_probs"]
    finally:
        classifier.close()


# -- images: a dual encoder's image column -----------------------------------------------------


@pytest.fixture(scope="module")
def clip(model_dir) -> str:
    return str(tiny_towers.make_clip(model_dir / "clip-ray"))


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    """The sample images as PNG files, and their bytes."""
    folder = tmp_path_factory.mktemp("ray-images")
    blobs = [tiny_towers.png_bytes(image) for image in tiny_towers.sample_images()]
    for i, blob in enumerate(blobs):
        (folder / f"{i}.png").write_bytes(blob)
    return folder, blobs


def test_an_image_column_of_bytes_and_paths_gives_the_engines_vectors(clip, image_folder):
    folder, blobs = image_folder
    paths = [str(folder / "0.png"), "1.png", "2.png", str(folder / "3.png"), "4.png"]
    embedder = EmbedBatches(clip, image_column="image", allowed_local_media_path=str(folder))
    try:
        want = embedder.engine.embed(tiny_towers.sample_images())
        for images in (blobs, paths):  # a binary column, a string one (relative: the folder's)
            table = embedder(pa.table({"id": range(5), "image": images}))
            assert table.column_names == ["id", "image", "embedding"]
            got = BlockAccessor.for_block(table).to_batch_format("numpy")["embedding"]
            assert got.shape == want.shape and _cosines(got, want).min() >= COS_MIN
        bad = [
            ([blobs[0], b"junk"], "row 1 of the batch (id=1): input 1: not a decodable image"),
            ([blobs[0], None], "row 1 of the batch (id=1): column 'image' holds None"),
            (["/etc/hostname"], "row 0 of the batch (id=0): input 0: /etc/hostname is outside"),
            ([tiny_towers.png_header(30_000, 30_000)], "row 0 of the batch (id=0): input 0: the "
             "image is over the limit"),
        ]  # fmt: skip
        for rows, said in bad:
            with pytest.raises(InvalidInputError) as caught:
                embedder(pa.table({"id": range(len(rows)), "image": rows}))
            assert said in str(caught.value)
        empty = embedder(
            pa.table({"id": pa.array([], pa.int64()), "image": pa.array([], pa.binary())})
        )
        assert empty.num_rows == 0 and empty.schema.field("embedding") == table.schema.field(
            "embedding"
        )
    finally:
        embedder.close()


def test_an_image_column_of_pixels_gives_the_engines_vectors(clip, image_folder):
    """Tensor columns, as ``ray.data.read_images`` makes them: uint8 pixels of one shape or of
    each row's own, [H, W] or [H, W, C]."""
    from PIL import Image
    from ray.data.extensions import ArrowTensorArray, ArrowVariableShapedTensorArray

    images = [image.convert("RGB") for image in tiny_towers.sample_images()]
    grey = [np.asarray(image.convert("L")) for image in images[:2]]
    embedder = EmbedBatches(clip, image_column="image")
    try:
        batches = [
            (ArrowVariableShapedTensorArray.from_numpy([np.asarray(i) for i in images]), images),
            (ArrowTensorArray.from_numpy(np.stack([np.asarray(images[0])] * 2)), images[:1] * 2),
            (ArrowVariableShapedTensorArray.from_numpy(grey), [Image.fromarray(g) for g in grey]),
        ]
        for column, want_images in batches:
            table = embedder(pa.table({"id": range(len(column)), "image": column}))
            got = BlockAccessor.for_block(table).to_batch_format("numpy")["embedding"]
            want = embedder.engine.embed(want_images)
            assert got.shape == want.shape and _cosines(got, want).min() >= COS_MIN
        floats = ArrowTensorArray.from_numpy(np.zeros((2, 8, 8, 3), np.float32))
        with pytest.raises(InvalidInputError, match=r"row 0 of the batch \(id=0\): column 'image' "
                           r"holds a float32 tensor of shape \(8, 8, 3\)"):  # fmt: skip
            embedder(pa.table({"id": range(2), "image": floats}))
    finally:
        embedder.close()


def test_an_image_column_is_refused_where_it_cannot_work(clip, minilm):
    with pytest.raises(InvalidInputError, match="give text_column or image_column"):
        EmbedBatches(clip, text_column="caption", image_column="image")
    with pytest.raises(
        InvalidInputError, match=r"needs a dual encoder .* \(BertModel\) embeds text"
    ):
        EmbedBatches(minilm, image_column="image")
    with pytest.raises(InvalidInputError, match="dense vectors only"):
        EmbedBatches(clip, image_column="image", output="token_embeddings")


# -- on the Ray cluster ------------------------------------------------------------------------


def test_two_actors_give_the_engines_vectors_for_2000_rows(cluster, minilm, minilm_engine):
    texts = _texts(2000)
    expected = minilm_engine.embed(texts)
    ds = ray.data.from_items([{"id": i, "text": t} for i, t in enumerate(texts)])
    out = ds.map_batches(
        EmbedBatches,
        fn_constructor_kwargs={
            "model": minilm,
            "text_column": "text",
            "output_column": "embedding",
        },
        compute=_pool(2),
        num_cpus=1,
        batch_size=250,
    )
    got = _numpy(out)
    assert got["id"].tolist() == list(range(2000))  # every row, once, in order
    assert got["text"].tolist() == texts
    assert got["embedding"].shape == (2000, 384)
    assert _cosines(got["embedding"], expected).min() >= COS_MIN


def test_bge_m3_outputs_and_cross_encoder_scores_match_the_engine(cluster, tmp_path_factory):
    """A pandas-format actor (BGE-M3's three outputs) feeding a pyarrow-format one (a
    cross-encoder): each passes the other's columns, and a string id and a float, through."""
    root = tmp_path_factory.mktemp("ray-models")
    m3 = str(tiny_retrieval.build_bge_m3(root / "m3"))
    cross_encoder = str(tiny_models.make_cross_encoder(root / "cross-encoder"))
    texts, documents = _texts(40, seed=2), _texts(40, seed=3)
    with Engine(m3) as engine:
        expected = engine.encode_outputs(texts, ("dense", "sparse", "multi_vector"))
    with Engine(cross_encoder) as engine:
        expected_scores = engine.score(texts, documents)
    items = [
        {"id": f"doc-{i}", "weight": i / 7, "text": t, "document": d}
        for i, (t, d) in enumerate(zip(texts, documents, strict=True))
    ]
    out = (
        ray.data.from_items(items)
        .map_batches(
            EmbedBatches,
            fn_constructor_kwargs={
                "model": m3,
                "output": ["dense", "sparse", "multi_vector"],
                "output_column": {"dense": "dense", "sparse": "lexical", "multi_vector": "colbert"},
            },
            compute=_pool(1),
            num_cpus=1,
            batch_size=16,
            batch_format="pandas",
        )
        .map_batches(
            EmbedBatches,
            fn_constructor_kwargs={
                "model": cross_encoder,
                "output": "score",
                "query_column": "text",
                "document_column": "document",
            },
            compute=_pool(1),
            num_cpus=1,
            batch_size=12,
            batch_format="pyarrow",
        )
    )
    got = _numpy(out)
    columns = ["id", "weight", "text", "document", "dense", "lexical_indices", "lexical_values"]
    assert list(got) == [*columns, "colbert", "score"]
    assert got["id"].tolist() == [item["id"] for item in items]
    assert got["weight"].tolist() == [item["weight"] for item in items]
    assert _cosines(got["dense"], expected.dense).min() >= COS_MIN
    assert expected.sparse is not None and expected.multi_vector is not None
    for i, sparse in enumerate(expected.sparse):
        np.testing.assert_array_equal(got["lexical_indices"][i], sparse.indices)
        np.testing.assert_allclose(got["lexical_values"][i], sparse.values, rtol=1e-4, atol=1e-6)
    for colbert, want in zip(got["colbert"], expected.multi_vector, strict=True):
        assert colbert.shape == want.shape
        assert _cosines(colbert, want).min() >= COS_MIN
    np.testing.assert_allclose(got["score"], expected_scores, rtol=1e-4, atol=1e-5)


def test_a_bad_row_fails_the_job_with_its_id(cluster, bert_path):
    items = [{"id": 100 + i, "text": "a text" if i != 3 else None} for i in range(8)]
    out = ray.data.from_items(items).map_batches(
        EmbedBatches,
        fn_constructor_kwargs={"model": str(bert_path)},
        compute=_pool(1),
        num_cpus=1,
        batch_size=8,
    )
    with pytest.raises(Exception, match=r"row 3 of the batch \(id=103\): column 'text' holds None"):
        out.materialize()


def test_pp2_actor_matches_and_its_stage_ends_with_the_job(cluster, minilm, minilm_engine):
    """Ray Data ends its actors when the job is done; the actor's stage process goes with it."""
    texts = _texts(96, seed=4)
    expected = minilm_engine.embed(texts)
    ds = ray.data.from_items([{"id": i, "text": t} for i, t in enumerate(texts)])
    out = ds.map_batches(
        EmbedBatches,
        fn_constructor_kwargs={"model": minilm, "pipeline_parallel_size": 2},
        compute=_pool(1),
        num_cpus=2,
        batch_size=16,
    )
    seen: set[int] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.update(_stage_pids(cluster))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        got = _numpy(out)
    finally:
        done.set()
        watcher.join()
    assert got["id"].tolist() == list(range(96))
    assert _cosines(got["embedding"], expected).min() >= COS_MIN
    assert seen, "the PP=2 actor ran a stage process"
    assert _wait_gone(cluster) == set()


def test_an_actor_embeds_an_image_column(cluster, clip, image_folder):
    from PIL import Image

    folder, blobs = image_folder
    rows = [{"id": i, "image": blobs[i % len(blobs)]} for i in range(20)]
    out = ray.data.from_items(rows).map_batches(
        EmbedBatches,
        fn_constructor_kwargs={"model": clip, "image_column": "image",
                               "allowed_local_media_path": str(folder)},
        compute=_pool(1),
        num_cpus=1,
        batch_size=8,
    )  # fmt: skip
    got = _numpy(out)
    # Ray's own image reader: a tensor column of each file's pixels.
    read = ray.data.read_images(str(folder), mode="RGB", include_paths=True).map_batches(
        EmbedBatches,
        fn_constructor_kwargs={"model": clip, "image_column": "image"},
        compute=_pool(1),
        num_cpus=1,
        batch_size=8,
    )
    pixels = _numpy(read)
    with Engine(clip) as engine:
        want = engine.embed([blobs[i % len(blobs)] for i in range(20)])
        from_files = engine.embed([Image.open(path).convert("RGB") for path in pixels["path"]])
    assert got["id"].tolist() == list(range(20))
    assert _cosines(got["embedding"], want).min() >= COS_MIN
    assert len(pixels["path"]) == len(blobs)
    assert _cosines(pixels["embedding"], from_files).min() >= COS_MIN


def test_no_stage_outlives_ray_shutdown(cluster, minilm, minilm_engine):
    """Last in the module: the cluster goes down under a live PP=2 actor (no graceful close)."""
    texts = _texts(8, seed=5)
    actor = ray.remote(num_cpus=2)(EmbedBatches).remote(minilm, pipeline_parallel_size=2)
    table = ray.get(actor.__call__.remote(pa.table({"id": range(8), "text": texts})))
    vectors = BlockAccessor.for_block(table).to_batch_format("numpy")["embedding"]
    assert _cosines(vectors, minilm_engine.embed(texts)).min() >= COS_MIN
    assert _stage_pids(cluster), "the actor's stage process is running"
    ray.shutdown()
    assert _wait_gone(cluster) == set()
