"""vLLM's ``/pooling`` tasks as pipepool's models do them (``api.routing.TASKS``).

vLLM names what a pooling model computes by ``task``: ``embed`` (one pooled vector per
input, what ``/v1/embeddings`` gives), ``token_embed`` (one vector per token), ``classify``
(one row of label probabilities per input) and ``token_classify`` (one per token). A request
that leaves ``task`` out gets the model's own task, chosen as vLLM chooses it: a token
classifier's ``token_classify``, else the first the model does of ``embed``, ``classify``,
``token_embed``."""

from __future__ import annotations

# The tasks of vLLM's /pooling that pipepool does. vLLM's others ("plugin",
# "embed&token_classify"), like any name, are a 400 naming the model's tasks (the route's
# check); the schema offers those of the server's models (``openapi.bound_schema``).
POOLING_TASKS = ("embed", "classify", "token_embed", "token_classify")
# What each of pipepool's tasks (``api.routing.TASKS``) does of vLLM's, in vLLM's order of
# preference for a request without ``task``.
TASKS_OF = {
    "embed": ("embed", "token_embed"),
    "classify": ("classify",),
    "classify_tokens": ("token_classify",),
}
_PREFERENCE = ("token_classify", "embed", "classify", "token_embed")
# The tasks that normalize applies to: those whose outputs are embeddings.
EMBEDDING_TASKS = ("embed", "token_embed")


def pooling_tasks(model_tasks: tuple[str, ...]) -> tuple[str, ...]:
    """vLLM's tasks a model does, in vLLM's order of preference (the first is its default),
    from what it does (``api.routing.TASKS``)."""
    done = {t for task in model_tasks for t in TASKS_OF.get(task, ())}
    return tuple(t for t in _PREFERENCE if t in done)
