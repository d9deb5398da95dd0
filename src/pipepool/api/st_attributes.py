"""What sentence-transformers' two model classes share, as adapters over an ``Engine``: the
``SentenceTransformer`` adapter (``st_compat.py``) and the ``CrossEncoder`` one
(``cross_encoder.py``) both build on ``STAdapter``: who owns the engine, and the attributes
``prompts``, ``default_prompt_name``, ``max_seq_length``, ``tokenizer`` and ``device``; the
settings behind them (``STSettings``), and the argument handling both share (``renamed``,
``refuse_unknown``, ``check_batch_size``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from ..errors import InvalidInputError
from .engine import Engine
from .engine_adapter import EngineAdapter
from .engine_info import EngineInfo

# Prompt names every SentenceTransformer has ("" unless the folder says otherwise), so that
# encode(prompt_name="query") works on any model, as there.
_DEFAULT_PROMPTS = ("query", "document")


@dataclass
class STSettings:
    """What sentence-transformers keeps on its model object and a caller may change. Read from
    the folder at first use; changes apply to this engine's sentence-transformers-style calls
    only (``embed``, the server and the CLI keep the folder's settings)."""

    prompts: dict[str, str]  # name -> text put before the input
    default_prompt_name: str | None  # applied when a call names no prompt
    similarity_fn_name: str | None  # one of st_compat.SIMILARITIES; None: cosine, on first use
    max_seq_length: int  # tokens kept of an input (special tokens included); <= max_model_len
    truncate_dim: int | None  # leading components kept of a sentence embedding; None: all
    # CrossEncoder: the activation a caller set for predict; None: the folder's.
    activation_fn: Callable[[torch.Tensor], torch.Tensor] | None = None

    @classmethod
    def of(cls, info: EngineInfo) -> STSettings:
        # As SentenceTransformer.__init__: the default names first, the folder's prompts fill
        # them and add theirs, names still unset become "". A CrossEncoder has no defaults.
        prompts: dict[str, str | None] = (
            dict.fromkeys(_DEFAULT_PROMPTS) if info.classifier is None else {}
        )
        for name, text in info.prompts.items():
            if prompts.get(name) is None:
                prompts[name] = text
        return cls(
            prompts={name: text or "" for name, text in prompts.items()},
            default_prompt_name=info.default_prompt_name,
            similarity_fn_name=info.similarity_fn_name,
            max_seq_length=info.max_model_len,
            truncate_dim=_saved_truncate_dim(info),
        )


class STAdapter(EngineAdapter):
    """What sentence-transformers' ``SentenceTransformer`` and ``CrossEncoder`` adapters share:
    an ``Engine`` (``engine``) and the attributes both model classes expose. Built from a model
    (a folder or hub id, with ``Engine`` options), the adapter starts its own engine and
    closes it in ``close()`` (or at the end of a ``with`` block); built from an ``Engine``, it
    shares that engine (other adapters, the caller's own calls) and ``close()`` leaves it
    running. Settings a caller changes here (``prompts``, ``max_seq_length``, ...) apply to
    this adapter's calls only (``STSettings``); the engine keeps the folder's."""

    def __init__(
        self, model: str | os.PathLike[str] | Engine | None = None, **engine_options: Any
    ) -> None:
        super().__init__(model, **engine_options)
        self._st = STSettings.of(self.engine.info)

    @property
    def prompts(self) -> dict[str, str]:
        """Prompt name -> text, as sentence-transformers has them (``query`` and ``document``
        always present for an embedding model); a caller may edit the dict."""
        return self._st.prompts

    @prompts.setter
    def prompts(self, value: dict[str, str]) -> None:
        self._st.prompts = dict(value)

    @property
    def default_prompt_name(self) -> str | None:
        """The prompt applied when a call gives neither ``prompt`` nor ``prompt_name``."""
        return self._st.default_prompt_name

    @default_prompt_name.setter
    def default_prompt_name(self, value: str | None) -> None:
        self._st.default_prompt_name = value

    @property
    def max_seq_length(self) -> int:
        """Tokens kept of each input (special tokens included); longer inputs are truncated, as
        by sentence-transformers. Starts at the engine's ``max_model_len``."""
        return self._st.max_seq_length

    @max_seq_length.setter
    def max_seq_length(self, value: int) -> None:
        """Any length from 1 to the engine's ``max_model_len``: the engine sized its position
        tables, step budget and KV cache for that, so a longer one needs a new engine."""
        limit = self.engine.info.max_model_len
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limit:
            raise InvalidInputError(
                f"max_seq_length must be an integer from 1 to {limit}, got {value!r}: this "
                f"engine was started with max_model_len={limit}; for longer inputs start an "
                "Engine with a larger max_model_len (up to the model's position limit)",
                param="max_seq_length",
            )
        self._st.max_seq_length = value
        if "tokenizer" in self.__dict__:  # as sentence-transformers: the tokenizer's too
            self.__dict__["tokenizer"].model_max_length = value

    @cached_property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer of the model folder (``AutoTokenizer``, what
        sentence-transformers gives; needs ``transformers``), its ``model_max_length`` the
        ``max_seq_length``. The engine itself tokenizes with ``tokenizer.json`` through
        ``tokenizers`` (``engine.tokenizer``)."""
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ImportError(
                "the adapter's tokenizer is the Hugging Face tokenizer sentence-transformers "
                "gives, which needs transformers (pip install transformers); the engine's own "
                "tokenizer is engine.tokenizer.backend (a tokenizers.Tokenizer)"
            ) from None
        tokenizer = AutoTokenizer.from_pretrained(self.engine.info.model_path)
        tokenizer.model_max_length = self.max_seq_length
        return tokenizer

    @property
    def device(self) -> torch.device:
        """Where the engine computes (its first stage's device)."""
        return torch.device(self.engine.info.devices[0])

    # -- helpers of both surfaces ---------------------------------------------------------------

    def _resolve_prompt(self, prompt: str | None, prompt_name: str | None) -> str | None:
        """sentence-transformers' rule: ``prompt`` wins, else the named prompt, else the
        default prompt's text, else none."""
        if prompt is not None:
            if not isinstance(prompt, str):
                raise InvalidInputError("prompt must be a string", param="prompt")
            return prompt
        if prompt_name is not None:
            if prompt_name not in self.prompts:
                raise InvalidInputError(
                    f"Prompt name {prompt_name!r} not found in the configured prompts dictionary "
                    f"with keys {list(self.prompts)!r}",
                    param="prompt_name",
                )
            return self.prompts[prompt_name]
        if self.default_prompt_name is not None:
            return self.prompts.get(self.default_prompt_name)
        return None

    def _check_device(self, device: Any, pool: Any = None) -> None:
        """``device`` (None, one device, or a list of devices) must name where the engine
        runs: pipepool does not move a running engine. A multi-process ``pool`` is refused:
        the engine spreads work over its own replicas."""
        if pool is not None:
            raise InvalidInputError(
                "a sentence-transformers multi-process pool cannot drive a pipepool engine: it "
                "spreads work over its own replicas (start the Engine with data_parallel_size=N)",
                param="pool",
            )
        if device is None:
            return
        running = {str(d) for d in self.engine.info.devices}
        for status in self.engine.pipeline.replica_status():
            running.update(str(d) for d in status.devices)
        for asked in device if isinstance(device, list) else [device]:
            try:
                wanted = torch.device(asked)
            except (RuntimeError, TypeError, ValueError):
                raise InvalidInputError(
                    f"device {asked!r} is not a device name", param="device"
                ) from None
            if not any(_same_device(wanted, torch.device(d)) for d in running):
                raise InvalidInputError(
                    f"this engine runs on {', '.join(sorted(running))} and computes there; it "
                    f"cannot move to device={str(asked)!r}: pass device=None (or the engine's "
                    "device), or start an Engine on that device (Engine(model, device=...))",
                    param="device",
                )


# -- argument handling as sentence-transformers does it -----------------------------------------


def check_batch_size(batch_size: int) -> None:
    """A positive integer, as sentence-transformers insists (the engine batches by tokens)."""
    if not isinstance(batch_size, int) or batch_size <= 0:
        raise InvalidInputError(
            f"batch_size must be a positive integer, got {batch_size!r}", param="batch_size"
        )


def renamed(kwargs: dict[str, Any], old: str, value: Any) -> Any:
    """A legacy keyword (``sentences=``) for the first argument."""
    if old in kwargs:
        if value is not None:
            raise InvalidInputError(f"give the inputs once, not also as {old}=", param=old)
        return kwargs.pop(old)
    return value


def refuse_unknown(kwargs: dict[str, Any], method: str) -> None:
    if kwargs:
        raise InvalidInputError(
            f"{method}() got keyword arguments this engine does not use: {sorted(kwargs)}",
            param=next(iter(kwargs)),
        )


def _same_device(asked: torch.device, running: torch.device) -> bool:
    """ "cuda" names any GPU; "cuda:1" only that one."""
    return asked.type == running.type and (
        asked.index is None or running.index is None or asked.index == running.index
    )


def _saved_truncate_dim(info: EngineInfo) -> int | None:
    """``truncate_dim`` of config_sentence_transformers.json (sentence-transformers saves one
    a model was built with); the engine's folder reader keeps no copy of it."""
    path = Path(info.model_path) / "config_sentence_transformers.json"
    if not info.sentence_transformers or not path.is_file():
        return None
    value = json.loads(path.read_text(encoding="utf-8")).get("truncate_dim")
    return value if isinstance(value, int) and value > 0 else None
