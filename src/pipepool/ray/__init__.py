"""Ray Data integration (``pip install 'pipepool[ray]'``): ``EmbedBatches``, a callable class for
``Dataset.map_batches`` that runs one Engine in each actor of a pool::

    import ray
    from pipepool.ray import EmbedBatches

    ds = ray.data.read_parquet("s3://bucket/docs/")           # columns: id, text
    ds = ds.map_batches(
        EmbedBatches,
        fn_constructor_kwargs={"model": "BAAI/bge-m3", "text_column": "text",
                               "output_column": "embedding", "pipeline_parallel_size": 2},
        compute=ray.data.ActorPoolStrategy(size=4),            # DP: 4 engines
        num_gpus=2,                                            # PP: 2 GPUs per engine
        batch_size=4096,
        batch_format="pyarrow",
    )
    ds.write_parquet("s3://bucket/embeddings/")              # id, text, embedding

Outputs (``output=``, see ``outputs.py``): "dense" (default), "sparse" (SPLADE, BGE-M3's lexical
weights: NAME_indices and NAME_values list columns), "multi_vector" (ColBERT, BGE-M3),
"token_embeddings", "score" (a cross-encoder over ``query_column`` and ``document_column``),
"classify"; BGE-M3's three at once with ``output=["dense", "sparse", "multi_vector"]``.
Per-call options (``prompt_name="query"``, ``is_query=True``, ``top_k=``, ``dimensions=``) go in
map_batches' ``fn_kwargs``; everything else in ``fn_constructor_kwargs`` is an engine option.

Every input column comes back unchanged and in row order (an id column included), the output
columns appended. Whatever ``batch_format`` (numpy, pandas, pyarrow) a call gets, it returns an
Arrow table, so the output columns have one type across the dataset; "pyarrow" spares Ray a
conversion of every batch. A row whose text is None, not a string or empty fails its batch with
an error naming the row (its position and its id); Ray Data then fails the job, unless
``DataContext.max_errored_blocks`` lets it skip that many failed blocks.

Resources. Each actor holds one Engine; the actor pool's size is data parallelism, the
engine's ``pipeline_parallel_size`` its pipeline parallelism:

- GPU: ``num_gpus=PP`` per actor, ``compute=ActorPoolStrategy(size=DP)`` (the older
  ``concurrency=DP`` means the same): PP x DP GPUs in all. Ray sets each actor's
  CUDA_VISIBLE_DEVICES, and the engine puts stage k on the actor's k-th GPU. An actor given
  fewer GPUs than stages fails at start with an error saying so.
- CPU: ``num_cpus=C`` per actor; the engine's stages split those C cores as threads
  (``cpu_threads``, taken from the actor's reserved CPUs unless given). An actor given no GPU
  runs its engine on the CPU unless ``device`` says otherwise (Ray no longer hides the host's
  GPUs from it).
- One actor = one engine = one model load. Bigger ``batch_size`` values (thousands of rows)
  keep the engine's token budget full. Calls are thread-safe: on a GPU,
  ``ActorPoolStrategy(size=DP, max_concurrent_calls_per_actor=2)`` lets Ray Data prepare the
  next batch while a call runs, and with ``enable_true_multi_threading=True`` two calls share
  the engine's steps (``benchmarks/ray_gpu.py`` measures each against the engine alone).

Stage processes end with their actor: Ray Data's graceful actor exit closes the engine
(``EmbedBatches.__del__``), and a stage process whose actor was killed (``ray.kill``, a crash,
``ray.shutdown()``) exits by itself once it sees its parent gone.

Multi-node: start Ray on every node (``ray start --head`` on one, ``ray start
--address=HEAD:6379`` on the others) and run the same program with ``ray.init(address="auto")``;
Ray Data places the actors across the nodes. An engine's PP stages stay on its actor's node
(local processes, NCCL within the host). Every node needs pipepool and the model (a hub id
each node can download, or a path on shared storage).

Resuming a failed job: Ray Data's own checkpointing (``ray.data.checkpoint``, beta in Ray 2.60,
which this was written against; older releases may lack it) records the ids of the rows each
write committed and, when the same job runs again, filters those rows out as it reads::

    from ray.data.checkpoint import CheckpointConfig

    ctx = ray.data.DataContext.get_current()
    ctx.checkpoint_config = CheckpointConfig(
        id_column="id", checkpoint_path="s3://bucket/checkpoints/embed-docs")
    ray.data.read_parquet(...).map_batches(EmbedBatches, ...).write_parquet(...)

It applies only to a dataset that starts with a read (``read_parquet``, ``read_json``, ...; not
``from_items``) and ends with a write to a datasink; the id column must hold unique values and
survive every operator (EmbedBatches passes it through). The checkpoint path must be cloud
storage or a file system every node mounts; it is deleted once a run succeeds
(``delete_checkpoint_on_success``). On a resumed run Ray adds a pool of checkpoint-filter actors
(one CPU and at least 1 GiB of memory each): leave room for them beside the EmbedBatches actors.
"""

from __future__ import annotations

try:
    import ray.data  # noqa: F401  (absolute: the Ray library, not this package)
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "pipepool.ray needs Ray Data: pip install 'pipepool[ray]' (or 'ray[data]>=2.40')"
    ) from exc

from .embed_batches import EmbedBatches

__all__ = ["EmbedBatches"]
