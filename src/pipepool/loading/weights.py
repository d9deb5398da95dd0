"""Checkpoint reading: every tensor name and shape is checked against what the model expects,
and each stage reads only the tensors of its own layers (safetensors are memory-mapped, so a
stage never holds the whole model)."""

from __future__ import annotations

import json
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import ModelLoadError
from ..models import Family, StageModel, WeightSpec


@dataclass(frozen=True)
class _Entry:
    file: Path
    name: str  # name as stored in the file
    shape: tuple[int, ...]


class Checkpoint:
    """Index of a folder's weights: canonical name -> (file, stored name, shape)."""

    def __init__(self, folder: Path, family: Family) -> None:
        self.folder, self.family = folder, family
        self.entries: dict[str, _Entry] = {}
        for file in _weight_files(folder):
            for name, shape in _read_shapes(file):
                canonical = family.canonical_name(name)
                if canonical in self.entries:
                    raise ModelLoadError(
                        f"{folder}: tensor {canonical!r} appears twice in the checkpoint"
                    )
                self.entries[canonical] = _Entry(file, name, shape)
        # Files opened so far: safetensors lazily, by tensor; pickled checkpoints whole.
        self._safetensors: dict[Path, safe_open] = {}
        self._pickled: dict[Path, dict[str, torch.Tensor]] = {}

    def verify(self, expected: Iterable[WeightSpec]) -> None:
        """Fail loudly on any missing, unexpected or misshaped tensor (checked once, for the
        whole model, before any stage loads)."""
        expected = list(expected)
        wanted = {s.checkpoint_name: s.shape for s in expected}
        missing = sorted(set(wanted) - set(self.entries))
        unexpected = sorted(
            n for n in self.entries if n not in wanted and not self.family.ignored.match(n)
        )
        wrong = [
            f"{n}: checkpoint {self.entries[n].shape}, model {shape}"
            for n, shape in wanted.items()
            if n in self.entries and self.entries[n].shape != shape
        ]
        problems = []
        if missing:
            problems.append(f"missing weights: {_short_list(missing)}")
        if unexpected:
            problems.append(f"unexpected weights: {_short_list(unexpected)}")
        if wrong:
            problems.append(f"shape mismatch: {_short_list(wrong)}")
        if problems:
            raise ModelLoadError(f"{self.folder}: " + "; ".join(problems))

    def load_stage(self, module: StageModel) -> None:
        """Copy this stage's tensors into ``module`` (already on its device and dtype) and
        check that every parameter element was written exactly once."""
        params = dict(module.named_parameters())
        filled: dict[str, int] = dict.fromkeys(params, 0)
        with torch.no_grad():
            for spec in module.weight_specs():
                target: torch.Tensor = params[spec.param]
                if spec.rows is not None:
                    target = target[spec.rows[0] : spec.rows[1]]
                target.copy_(self.read(spec.checkpoint_name, spec.source_rows))
                filled[spec.param] += target.shape[0] if target.dim() else 1
        unfilled = [n for n, p in params.items() if filled[n] != (p.shape[0] if p.dim() else 1)]
        if unfilled:
            raise ModelLoadError(f"parameters left unloaded: {_short_list(unfilled)}")

    def read(self, canonical: str, rows: tuple[int, ...] | None = None) -> torch.Tensor:
        """A tensor, or only ``rows`` of it (in that order): a safetensors file reads just
        those rows, so two rows of a 150k-token LM head cost two rows."""
        entry = self.entries[canonical]
        if entry.file.suffix == ".safetensors":
            handle = self._safetensors.get(entry.file)
            if handle is None:
                handle = self._safetensors[entry.file] = safe_open(str(entry.file), framework="pt")
            if rows is not None:
                part = handle.get_slice(entry.name)
                return torch.cat([part[r : r + 1] for r in rows])
            return handle.get_tensor(entry.name)
        tensors = self._pickled.get(entry.file)
        if tensors is None:
            tensors = self._pickled[entry.file] = _torch_load(entry.file)
        tensor = tensors[entry.name]
        return tensor[list(rows)] if rows is not None else tensor

    def close(self) -> None:
        self._safetensors.clear()
        self._pickled.clear()


def _weight_files(folder: Path) -> list[Path]:
    """Single or sharded safetensors first; pytorch_model.bin (single or sharded) as fallback."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = folder / index_name
        if index.is_file():
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted({folder / name for name in weight_map.values()})
            absent = [f.name for f in files if not f.is_file()]
            if absent:
                raise ModelLoadError(
                    f"{folder}: shards named in {index_name} are missing: {absent}"
                )
            return files
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (folder / name).is_file():
            return [folder / name]
    raise ModelLoadError(
        f"{folder} holds no weights (model.safetensors, pytorch_model.bin, or an index)"
    )


def _read_shapes(file: Path) -> list[tuple[str, tuple[int, ...]]]:
    if file.suffix == ".safetensors":
        try:
            with safe_open(str(file), framework="pt") as f:
                return [(name, tuple(f.get_slice(name).get_shape())) for name in f.keys()]  # noqa: SIM118
        except Exception as exc:  # a truncated or corrupt file: SafetensorError, OSError
            raise ModelLoadError(f"cannot read {file}: {exc}") from None
    return [(name, tuple(t.shape)) for name, t in _torch_load(file).items()]


def _torch_load(file: Path) -> dict[str, torch.Tensor]:
    # Files from PyTorch < 1.6 (the legacy, non-zip format) cannot be memory-mapped.
    mmap = zipfile.is_zipfile(file)
    try:
        return torch.load(file, map_location="cpu", mmap=mmap, weights_only=True)
    except Exception as exc:
        raise ModelLoadError(f"cannot read {file}: {exc}") from None


def _short_list(items: list[str], limit: int = 8) -> str:
    head = ", ".join(items[:limit])
    return head + (f" (and {len(items) - limit} more)" if len(items) > limit else "")


def load_linear(folder: Path) -> dict[str, torch.Tensor]:
    """The tensors of a small sentence-transformers module folder (e.g. ``2_Dense``)."""
    for name in ("model.safetensors", "pytorch_model.bin"):
        file = folder / name
        if file.is_file():
            if file.suffix == ".safetensors":
                with safe_open(str(file), framework="pt") as f:
                    return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
            return dict(_torch_load(file))
    raise ModelLoadError(f"{folder} holds no weights")


@dataclass(frozen=True)
class PtLinear:
    """A ``torch.nn.Linear`` state dict saved on its own (FlagEmbedding's ``*.pt`` heads)."""

    weight: torch.Tensor  # [out, in]
    bias: torch.Tensor | None  # [out]

    @property
    def shape_out(self) -> int:
        return int(self.weight.shape[0])


def load_pt_linear(file: Path, in_features: int, out_features: int | None) -> PtLinear:
    """``file``'s Linear weights, checked: ``weight`` [out, in] (out as given, any if None), an
    optional ``bias`` [out], and nothing else."""
    tensors = _torch_load(file)
    weight, bias = tensors.get("weight"), tensors.get("bias")
    extra = sorted(set(tensors) - {"weight", "bias"})
    if weight is None or weight.dim() != 2 or extra:
        raise ModelLoadError(
            f"{file}: expected a Linear state dict (weight, bias); found {sorted(tensors)}"
        )
    out = int(weight.shape[0])
    if weight.shape[1] != in_features or (out_features is not None and out != out_features):
        want = f"[{out_features if out_features is not None else 'n'}, {in_features}]"
        raise ModelLoadError(f"{file}: weight of shape {list(weight.shape)}, expected {want}")
    if bias is not None and tuple(bias.shape) != (out,):
        raise ModelLoadError(f"{file}: bias of shape {list(bias.shape)}, expected [{out}]")
    return PtLinear(weight, bias)
