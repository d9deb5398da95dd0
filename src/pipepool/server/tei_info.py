"""TEI's ``GET /info``: the served model and the server's limits by text-embeddings-inference's
names (its ``Info``), each from what pipepool really runs with; pipepool's own additions are
``served_model_names`` and ``limits`` (every limit on a request, by the flag that sets it)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import __version__

if TYPE_CHECKING:
    from ..api.engine_info import EngineInfo
    from .routes.shared import ServerState

# pipepool's pooling names as TEI names them.
_TEI_POOLING = {"cls": "cls", "mean": "mean", "last": "last_token"}


def tei_info(state: ServerState) -> dict[str, Any]:
    """The first model's ``/info`` (a server of several models describes the first it was
    given; ``/v1/models`` lists them all). Fields that need the loaded model are null while it
    loads."""
    model = state.models.first
    settings = state.settings
    out: dict[str, Any] = {
        "model_id": model.name,
        "model_sha": None,
        "model_dtype": None,
        "served_model_name": model.name,
        "model_type": None,
        "max_concurrent_requests": model.front.max_queued,
        "max_input_length": None,
        "max_batch_tokens": None,
        "max_batch_requests": None,
        "max_client_batch_size": settings.max_inputs_per_request,
        "auto_truncate": None,
        "tokenization_workers": model.front.tokenizer_threads,
        "version": __version__,
        "sha": None,  # the build's git commit: a pip-installed pipepool has none
        "docker_label": None,  # no container image of pipepool's own
        "served_model_names": list(model.names.shown),
        "limits": {
            "max_inputs_per_request": settings.max_inputs_per_request,
            "max_tokens_per_request": settings.max_tokens_per_request,
            "max_chunked_tokens": settings.max_chunked_tokens,
            "max_body_bytes": settings.max_body_bytes,
            "max_queued_requests": model.front.max_queued,
        },
    }
    engine = model.front.owner.engine
    if engine is None:
        return out
    info = engine.info
    out.update(
        model_sha=model_sha(Path(info.model_path)),
        model_dtype=info.dtype,
        model_type=model_type(info),
        max_input_length=info.max_model_len,
        max_batch_tokens=info.max_num_batched_tokens,
        max_batch_requests=info.max_num_seqs,
        auto_truncate=info.long_inputs == "truncate",
    )
    return out


def model_type(d: EngineInfo) -> dict[str, Any]:
    """TEI's ModelType: ``reranker`` for a one-label classifier, ``classifier`` for another,
    ``embedding`` with its pooling (``splade`` for a model whose only output is sparse)."""
    head = d.classifier
    if head is not None:
        kind = "reranker" if head.can_rerank else "classifier"
        return {
            kind: {
                "id2label": {str(i): name for i, name in enumerate(head.labels)},
                "label2id": {name: i for i, name in enumerate(head.labels)},
            }
        }
    pooling = "splade" if d.outputs == ("sparse",) else _TEI_POOLING.get(d.pooling, d.pooling)
    return {"embedding": {"pooling": pooling}}


def model_sha(path: Path) -> str | None:
    """The hub revision of a model loaded from the Hugging Face cache (its folder is
    ``snapshots/<commit>``); None for any other folder."""
    return path.name if path.parent.name == "snapshots" else None
