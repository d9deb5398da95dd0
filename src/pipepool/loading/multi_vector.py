"""A sentence-transformers 6 ``MultiVectorEncoder`` folder (``model_type: MultiVectorEncoder``):
what its modules ask for, read from their config files (no torch here).

sentence-transformers saves such a model as a Transformer whose ``sentence_bert_config.json``
carries the late-interaction settings (``query_length``, ``document_length``,
``query_expansion``), token-level ``Dense`` projections, a ``MultiVectorMask`` (which tokens
are scored: expansion positions of queries in, skiplist tokens out) and a token-level
``Normalize``; the query and document prefixes are plain text prompts
(``config_sentence_transformers.json``). ``retrieval.read_multi_vector`` turns this into the
``ColbertHead`` the engine runs. Every other module, and every setting pipepool does not apply,
is refused by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelLoadError
from .st_dense import DenseModule, read_st_dense

MULTI_VECTOR_ENCODER = "MultiVectorEncoder"
# The modules a MultiVectorEncoder folder may hold (their class names, sentence-transformers').
_MODULES = ("Transformer", "Dense", "MultiVectorMask", "Normalize")
_EXPANSION_KEYS = frozenset({"strategy", "attend", "token", "length"})
_EXPANSION_STRATEGIES = ("fixed", "min")
_SKIPLIST_TASKS = frozenset({"query", "document"})
# similarity_fn_name values whose scores pipepool computes (MaxSim, summed over query tokens).
_SIMILARITIES = (None, "maxsim")
# The Transformer settings of sentence_bert_config.json read here (the others: model_folder).
TRANSFORMER_KEYS = ("query_length", "document_length", "query_expansion")


@dataclass(frozen=True)
class QueryExpansion:
    """Queries padded with ``token`` (None: the tokenizer's mask token, else its EOS) up to
    ``length`` tokens; ``fixed`` also cuts them at ``length``, ``min`` only pads. The padding
    is attended to by the other tokens only when ``attend``."""

    strategy: str
    length: int
    attend: bool
    token: str | None


@dataclass(frozen=True)
class MultiVectorModules:
    """A MultiVectorEncoder folder's settings beyond its transformer."""

    dense: tuple[DenseModule, ...]  # token-level projections, in order
    normalize: bool  # a token-level Normalize module is present
    query_length: int | None  # queries cut to this many tokens (None: the model's limit)
    document_length: int | None  # documents likewise
    expansion: QueryExpansion | None
    skiplist_words: tuple[str, ...]  # tokens whose vectors are not scored
    skiplist_tasks: frozenset[str]  # where the skiplist applies: "document" and/or "query"


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None


def _positive(where: Path, key: str, value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelLoadError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def _read_expansion(where: Path, value) -> QueryExpansion | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{where}: query_expansion must be an object, got {value!r}")
    unknown = sorted(set(value) - _EXPANSION_KEYS)
    if unknown:
        raise ModelLoadError(f"{where}: query_expansion key {unknown[0]!r} is not supported")
    strategy = value.get("strategy")
    if strategy not in _EXPANSION_STRATEGIES:
        raise ModelLoadError(
            f"{where}: query_expansion strategy {strategy!r} is not supported "
            f"({', '.join(_EXPANSION_STRATEGIES)} are)"
        )
    attend = value.get("attend", False)
    token = value.get("token")
    if not isinstance(attend, bool) or not (token is None or isinstance(token, str)):
        raise ModelLoadError(f"{where}: query_expansion attend/token malformed: {value!r}")
    length = _positive(where, "query_expansion length", value.get("length"))
    if length is None:
        raise ModelLoadError(f"{where}: query_expansion needs a length")
    return QueryExpansion(strategy=strategy, length=length, attend=attend, token=token)


def _read_mask(folder: Path) -> tuple[tuple[str, ...], frozenset[str]]:
    config = _read_json(folder / "config.json")
    unknown = sorted(set(config) - {"skiplist_words", "skiplist_tasks", "keep_only_token_ids"})
    if unknown:
        raise ModelLoadError(f"{folder}: MultiVectorMask option {unknown[0]!r} is not supported")
    if config.get("keep_only_token_ids") is not None:
        raise ModelLoadError(
            f"{folder}: MultiVectorMask keep_only_token_ids (an image-patch allowlist) is not "
            "supported"
        )
    words = config.get("skiplist_words") or []
    tasks = config.get("skiplist_tasks")
    tasks = ["document"] if tasks is None else [tasks] if isinstance(tasks, str) else tasks
    if not all(isinstance(w, str) for w in words) or not set(tasks) <= _SKIPLIST_TASKS:
        raise ModelLoadError(
            f"{folder}: MultiVectorMask skiplist_words must be strings and skiplist_tasks "
            f"among {sorted(_SKIPLIST_TASKS)}; got {words!r}, {tasks!r}"
        )
    return tuple(words), frozenset(tasks)


def _read_normalize(folder: Path) -> None:
    config = _read_json(folder / "config.json") if (folder / "config.json").is_file() else {}
    for key, value in config.items():
        if key not in ("module_input_name", "module_output_name") or value != "token_embeddings":
            raise ModelLoadError(
                f"{folder}: Normalize {key}={value!r} is not supported in a "
                "MultiVectorEncoder (it normalises token_embeddings)"
            )


def _check_token_level(folder: Path) -> None:
    """A Dense of a MultiVectorEncoder projects every token: its input and output are the
    token embeddings (sentence-transformers' default there)."""
    config = _read_json(folder / "config.json")
    for key in ("module_input_name", "module_output_name"):
        value = config.get(key, "token_embeddings")
        if value != "token_embeddings":
            raise ModelLoadError(
                f"{folder}: Dense {key}={value!r} is not supported in a MultiVectorEncoder "
                "(its Dense modules project token_embeddings)"
            )


def read_multi_vector_modules(
    path: Path, modules: list[tuple[dict, str]], st_config: dict, transformer: dict
) -> MultiVectorModules:
    """The settings of a MultiVectorEncoder folder at ``path``: ``modules`` its modules.json
    entries in order with their class names, ``st_config`` its
    config_sentence_transformers.json, ``transformer`` its sentence_bert_config.json."""
    where = path / "modules.json"
    kinds = [kind for _, kind in modules]
    for kind in kinds:
        if kind not in _MODULES:
            raise ModelLoadError(
                f"{where}: module {kind!r} is not supported in a MultiVectorEncoder (pipepool "
                f"runs {', '.join(_MODULES)})"
            )
    tail = kinds[1 + kinds.count("Dense") :]
    if (
        kinds[:1] != ["Transformer"]
        or kinds[1 : 1 + kinds.count("Dense")] != ["Dense"] * kinds.count("Dense")
        or sorted(tail) not in (["MultiVectorMask"], ["MultiVectorMask", "Normalize"])
    ):
        raise ModelLoadError(
            f"{where}: pipepool runs a MultiVectorEncoder made of a Transformer, token-level "
            f"Dense modules, a MultiVectorMask and a Normalize, in that order; this one has "
            f"{', '.join(kinds)}"
        )
    similarity = st_config.get("similarity_fn_name")
    if similarity not in _SIMILARITIES:
        raise ModelLoadError(
            f"{path}: similarity_fn_name {similarity!r} is not supported (pipepool scores "
            "MaxSim: maxsim)"
        )
    dense = []
    words: tuple[str, ...] = ()
    tasks: frozenset[str] = frozenset()
    for module, kind in modules:
        folder = path / module.get("path", "")
        if kind == "Dense":
            _check_token_level(folder)
            dense.append(read_st_dense(folder))
        elif kind == "MultiVectorMask":
            words, tasks = _read_mask(folder)
        elif kind == "Normalize":
            _read_normalize(folder)
    bert_config = path / "sentence_bert_config.json"
    expansion = _read_expansion(bert_config, transformer.get("query_expansion"))
    query_length = _positive(bert_config, "query_length", transformer.get("query_length"))
    if expansion is not None and query_length is not None and query_length < expansion.length:
        raise ModelLoadError(
            f"{bert_config}: query_length {query_length} is below query_expansion's length "
            f"{expansion.length} (sentence-transformers refuses it too)"
        )
    return MultiVectorModules(
        dense=tuple(dense),
        normalize="Normalize" in kinds,
        query_length=query_length,
        document_length=_positive(
            bert_config, "document_length", transformer.get("document_length")
        ),
        expansion=expansion,
        skiplist_words=words,
        skiplist_tasks=tasks,
    )
