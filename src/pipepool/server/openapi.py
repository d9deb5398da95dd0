"""What the OpenAPI schema says beyond what pydantic derives from the request models: the bounds
the server checks itself, and those that depend on its settings and on its model.

The server checks some values after validation, with messages that name the input at fault
("input 2 is an empty string", "tokens 3 is 40000, outside this model's vocabulary"), which
pydantic's own constraints would replace with its generic ones. The types here state such a
bound in the schema alone; validation stays the server's. A bound that depends on this server
is marked (``x-bounded-by``, ``x-token-ids``) and filled in by ``bound_schema`` from the
settings, and from the model once it is loaded (until then every model route answers 503).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BeforeValidator, Field, StrictInt, StrictStr, WithJsonSchema

from .pooling_tasks import POOLING_TASKS, pooling_tasks

if TYPE_CHECKING:
    from ..api.engine import Engine
    from .models import ServedModels
    from .settings import ServerSettings

BOUNDED_BY = "x-bounded-by"  # names a ModelBounds field, or "inputs" (the settings' limit)
TOKEN_IDS = "x-token-ids"  # a form of input taken only with --allow-token-ids
PAIR_OPTION = "x-pair-option"  # a pair-scoring option of some models only (its name)


def _schema(**extra: Any) -> Any:
    return Field(json_schema_extra=extra)


def _integral(value: object) -> object:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# JSON Schema's integer: 2.0 is one (JSON has one number type), true and "2" are not.
Integer = Annotated[StrictInt, BeforeValidator(_integral)]


def inputs_bound(min_items: int = 1, **extra: Any) -> Any:
    """The bounds of a list of inputs: at least ``min_items``, at most
    --max-inputs-per-request."""
    return _schema(minItems=min_items, **{BOUNDED_BY: "inputs"}, **extra)


# A text the server refuses when empty.
Text = Annotated[StrictStr, _schema(minLength=1)]
Texts = Annotated[list[Text], inputs_bound()]
# Texts that may be empty (each half of a query-document pair).
AnyTexts = Annotated[list[StrictStr], inputs_bound()]
TokenId = Annotated[Integer, _schema(minimum=0, **{BOUNDED_BY: "vocab_size"})]
# One input given as token ids, and a list of them.
TokenIds = Annotated[list[TokenId], _schema(minItems=1, **{TOKEN_IDS: True})]
TokenIdLists = Annotated[list[TokenIds], inputs_bound(**{TOKEN_IDS: True})]
# Matryoshka: the first N dimensions of the model's vectors.
Dimensions = Annotated[Integer, _schema(minimum=1, **{BOUNDED_BY: "output_dim"})]
PromptName = Annotated[StrictStr, _schema(**{BOUNDED_BY: "prompt_names"})]
# A token count to truncate to: -1 (max_model_len) or 1 .. max_model_len.
TruncateTokens = Annotated[
    Integer,
    WithJsonSchema(
        {
            "anyOf": [
                {"const": -1},
                {"type": "integer", "minimum": 1, BOUNDED_BY: "max_model_len"},
            ]
        }
    ),
]
PositiveInt = Annotated[Integer, _schema(minimum=1)]
NonNegativeInt = Annotated[Integer, _schema(minimum=0)]
# Checked by validation, for a field the server reads for some requests only. (The bound goes
# before the float conversion, or pydantic states it as "ge", no JSON Schema keyword.)
CheckedPositiveInt = Annotated[StrictInt, Field(ge=1), BeforeValidator(_integral)]


def one_of_fields(*names: str) -> dict[str, Any]:
    """A model's ``json_schema_extra``: exactly one of the fields ``names`` given, not null
    (the others absent or null)."""
    return {
        "anyOf": [
            {
                "required": [name],
                "properties": {
                    other: ({"not": {"type": "null"}} if other == name else {"type": "null"})
                    for other in names
                },
            }
            for name in names
        ]
    }


@dataclass(frozen=True)
class ModelBounds:
    """What the loaded model allows, as the schema states it."""

    vocab_size: int  # token ids are in [0, vocab_size)
    output_dim: int  # components of a dense vector (Matryoshka dimensions at most this)
    max_model_len: int  # the most tokens truncate_prompt_tokens may keep
    prompt_names: tuple[str, ...]  # the model's prompts (sentence-transformers' config)
    # Request options for some models only (``retrieval_scoring.pair_options``): the schema
    # offers a field marked PAIR_OPTION where its name is one of these.
    pair_options: frozenset[str] = frozenset()
    # vLLM's /pooling tasks it does (``pooling_protocol.pooling_tasks``)
    tasks: tuple[str, ...] = ()

    @classmethod
    def of(cls, engine: Engine) -> ModelBounds:
        info = engine.info
        return cls(
            vocab_size=info.vocab_size,
            output_dim=info.dimensions,
            max_model_len=info.max_model_len,
            prompt_names=tuple(sorted(info.prompts)),
            pair_options=info.pair_options,
            tasks=pooling_tasks(info.tasks),
        )

    @classmethod
    def widest(cls, bounds: list[ModelBounds]) -> ModelBounds:
        """What any of several models allows."""
        return cls(
            vocab_size=max(b.vocab_size for b in bounds),
            output_dim=max(b.output_dim for b in bounds),
            max_model_len=max(b.max_model_len for b in bounds),
            prompt_names=tuple(sorted({n for b in bounds for n in b.prompt_names})),
            pair_options=frozenset().union(*(b.pair_options for b in bounds)),
            tasks=tuple(t for t in POOLING_TASKS if any(t in b.tasks for b in bounds)),
        )


def bound_by_server(schema: dict, settings: ServerSettings, models: ServedModels) -> None:
    """``bound_schema`` with this server's settings and, once every model is loaded, the
    widest of their bounds (a request the schema allows is one some model may take)."""
    engines = [m.front.owner.engine for m in models]
    bounds = [ModelBounds.of(e) for e in engines if e is not None]
    widest = ModelBounds.widest(bounds) if bounds and len(bounds) == len(engines) else None
    bound_schema(schema, settings, widest)


def bound_schema(schema: dict, settings: ServerSettings, model: ModelBounds | None) -> None:
    """Fill in, in place, the bounds marked in ``schema`` (an OpenAPI document): without
    ``--allow-token-ids`` no token-id forms of input; lists of inputs at most
    ``--max-inputs-per-request``; with ``model``, its vocabulary, vector size, max_model_len
    and prompt names. Idempotent: the markers stay, so that it may run again once the model
    is loaded."""
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        for key in ("anyOf", "oneOf"):
            if key in node:
                node[key] = [b for b in node[key] if _allowed(b, settings, model)]
        bound = node.get(BOUNDED_BY)
        if bound == "inputs":
            node["maxItems"] = settings.max_inputs_per_request
        elif bound == "prompt_names" and model is not None:
            node["enum"] = list(model.prompt_names)
        elif bound == "tasks" and model is not None and model.tasks:
            node["enum"] = list(model.tasks)
        elif bound == "vocab_size" and model is not None:
            node["maximum"] = model.vocab_size - 1
        elif bound in ("output_dim", "max_model_len") and model is not None:
            node["maximum"] = getattr(model, bound)
        stack.extend(node.values())


def _allowed(branch: object, settings: ServerSettings, model: ModelBounds | None) -> bool:
    """Whether a branch of an ``anyOf`` is a form this server takes."""
    if not isinstance(branch, dict):
        return True
    if branch.get(TOKEN_IDS) and not settings.allow_token_ids:
        return False
    # A model without prompts takes no prompt_name, and a pair option only where it applies
    # (BGE-M3's weights, Qwen3-Reranker's instruction): such a field may only be null.
    if model is None:
        return True
    if not model.prompt_names and branch.get(BOUNDED_BY) == "prompt_names":
        return False
    option = branch.get(PAIR_OPTION)
    return option is None or option in model.pair_options
