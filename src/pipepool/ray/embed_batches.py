"""``EmbedBatches``: the callable class Ray Data's ``map_batches`` runs in a pool of actors, one
Engine per actor."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import ray

from ..core.dual_encoders import DUAL_ENCODERS
from ..errors import InvalidInputError
from .columns import as_table, describe_row, images_of, texts_of
from .outputs import OutputPlan, check_model, compute, plan_outputs

if TYPE_CHECKING:
    from ..api.engine import Engine

# Engine errors about devices, which an actor holding too few GPUs raises.
_PLACEMENT_PARAMS = ("pipeline_parallel_size", "data_parallel_size")


class EmbedBatches:
    """A Ray Data ``map_batches`` UDF that adds a pooling model's outputs to every batch::

        ds.map_batches(EmbedBatches, fn_constructor_kwargs={"model": path, **options},
                       compute=ray.data.ActorPoolStrategy(size=DP), num_gpus=PP, batch_size=B)

    What a caller may rely on:

    - The constructor, which Ray runs once in each actor, opens one ``Engine`` (``engine``) on
      ``model`` with ``engine_options`` (``EngineConfig`` fields: ``pipeline_parallel_size``,
      ``dtype``, ...): its stages run on the GPUs Ray gave the actor (``num_gpus`` = PP), or, in
      an actor given no GPU, on the CPU with the actor's CPUs as their threads (``device`` and
      ``cpu_threads`` say otherwise where given). It raises InvalidInputError for an option,
      output or model that cannot work, before any batch.
    - The engine's stage processes end with the actor: ``close`` runs on the actor's graceful
      exit (through ``__del__``) and at its interpreter's exit; a stage process whose actor was
      killed exits on its own once it sees its parent gone.
    - A call takes a batch in any of Ray's formats ("numpy", "pandas", "pyarrow") and returns it
      as an Arrow table: every input column unchanged, rows in input order, the output columns
      (``outputs.py``) appended. An empty batch gives empty columns of the same types.
    - A row whose input is not a non-empty string fails the batch with InvalidInputError naming
      the row (its position in the batch and its short values, such as an id). An output
      column that the batch already has fails it too: nothing is overwritten.
    - ``image_column`` (a dual encoder's, CLIP or SigLIP): the rows' images are embedded
      instead of texts, dense vectors in the same space as the texts'. A binary column holds
      images' bytes, a string one files' paths (relative ones under
      ``allowed_local_media_path``, an engine option, which every file must lie under), a
      tensor one (``ray.data.read_images``') their uint8 pixels; an image refused (not
      decodable, over ``max_image_pixels``, a file outside the folder, a tensor that is no
      image) fails the batch naming its row.
    - Keyword arguments of a call (map_batches' ``fn_kwargs``) go to the engine method unchanged:
      ``prompt_name``, ``dimensions``, ``is_query``, ``top_k``, ``truncate_prompt_tokens``,
      ``instruction``, ...
    - Calls are thread-safe (so is the engine): an actor may run several at once
      (``ActorPoolStrategy(max_concurrent_calls_per_actor=...)``).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        text_column: str | None = None,
        image_column: str | None = None,
        output: str | Sequence[str] = "dense",
        output_column: str | Mapping[str, str] | None = None,
        query_column: str = "query",
        document_column: str = "document",
        **engine_options: Any,
    ) -> None:
        if text_column is not None and image_column is not None:
            raise InvalidInputError(
                "give text_column or image_column: a call embeds one modality",
                param="image_column",
            )
        self.image_column = image_column
        self.plan = plan_outputs(
            output,
            output_column,
            text_column=image_column or text_column or "text",
            query_column=query_column,
            document_column=document_column,
        )
        from ..api.engine import Engine  # torch and the model: in the actor, not the driver

        options = _with_actor_resources(engine_options)
        try:
            self.engine: Engine = Engine(model, **options)
        except InvalidInputError as exc:
            if exc.param not in _PLACEMENT_PARAMS:
                raise
            raise InvalidInputError(
                f"{exc} (this Ray actor holds {_actor_gpus()} GPU(s): give map_batches "
                "num_gpus=pipeline_parallel_size)",
                param=exc.param,
            ) from exc
        try:
            check_model(self.engine, self.plan)
            if image_column is not None:
                _check_images(self.engine, self.plan)
        except BaseException:
            self.close()
            raise

    def __call__(self, batch: object, **options: Any) -> pa.Table:
        table = as_table(batch)
        taken = [c for c in self.plan.columns if c in table.column_names]
        if taken:
            raise InvalidInputError(
                f"the batch already has column {taken[0]!r}: name the output another way "
                "(output_column)",
                param="output_column",
            )
        inputs: list[list]  # texts per input column; or the one image column's images
        if self.image_column is not None:
            folder = self.engine.config.allowed_local_media_path
            inputs = [images_of(table, self.image_column, folder)]
        else:
            inputs = [texts_of(table, column) for column in self.plan.inputs]
        try:
            columns = compute(self.engine, self.plan, inputs, options)
        except InvalidInputError as exc:
            if exc.index is None or not 0 <= exc.index < table.num_rows:
                raise
            skip = self.plan.inputs[0]
            raise InvalidInputError(
                f"{describe_row(table, exc.index, skip=skip)}: {exc}",
                param=exc.param,
                index=exc.index,
            ) from exc
        for name, column in columns.items():
            table = table.append_column(name, column)
        return table

    def close(self) -> None:
        """Stop the engine and its stage processes (idempotent)."""
        engine = getattr(self, "engine", None)  # None where the constructor failed
        if engine is not None:
            engine.close()

    def __del__(self) -> None:
        # Not contextlib.suppress: at interpreter exit module globals may already be None.
        try:  # noqa: SIM105
            self.close()
        except Exception:
            pass


def _check_images(engine: Engine, plan: OutputPlan) -> None:
    """Refuse ``image_column`` where images cannot be embedded: a model without a vision
    tower, outputs other than dense vectors (an image gives its pooled vector only)."""
    architecture = engine.info.architecture
    if architecture not in DUAL_ENCODERS:
        raise InvalidInputError(
            f"image_column needs a dual encoder ({', '.join(DUAL_ENCODERS)}); this model "
            f"({architecture}) embeds text",
            param="image_column",
        )
    if plan.kinds != ("dense",):
        raise InvalidInputError(
            f"image_column gives dense vectors only (an image's pooled vector); output "
            f"{', '.join(plan.kinds)} is not one",
            param="output",
        )


def _with_actor_resources(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` completed from what Ray reserved for this actor, where the caller left them
    unset: ``device`` "cpu" for an actor that holds no GPU (Ray 2.60 no longer hides the host's
    GPUs from such an actor, and "auto" would take one Ray gave to another), ``cpu_threads`` its
    CPUs (CPU stages split the actor's share, not every core of the host, which each actor of a
    pool would otherwise claim)."""
    if not ray.is_initialized():
        return options
    context = ray.get_runtime_context()
    if context.get_actor_id() is None:  # the driver, or a plain task
        return options
    completed = dict(options)
    if "device" not in options and not ray.get_gpu_ids():
        completed["device"] = "cpu"
    cpus = context.get_assigned_resources().get("CPU")
    if "cpu_threads" not in options and cpus:
        completed["cpu_threads"] = max(1, int(cpus))
    return completed


def _actor_gpus() -> int:
    return len(ray.get_gpu_ids()) if ray.is_initialized() else 0
