"""Tiny dual encoders (CLIP, SigLIP) with random weights, written by transformers from real
configs shrunk, with a small BPE tokenizer and the checkpoint's own image processor config;
and test images."""

from __future__ import annotations

import io
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import torch
from tiny_models import _train_bpe

_TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4)
IMAGE_SIZE, PATCH = 32, 8


def make_clip(path: Path, seed: int = 0) -> Path:
    """CLIPModel (openai/clip-vit-base-patch32's config, shrunk): causal text tower pooling
    its EOS, vision tower with a class token, both projected to 24 components."""
    from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel

    _train_bpe(path, bos="<|startoftext|>", eos="<|endoftext|>")
    vocab = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]
    eos = vocab["<|endoftext|>"]
    config = CLIPConfig(
        text_config=dict(**_TOWER, vocab_size=len(vocab), max_position_embeddings=77,
                         bos_token_id=vocab["<|startoftext|>"], eos_token_id=eos, pad_token_id=eos),
        vision_config=dict(**_TOWER, image_size=IMAGE_SIZE, patch_size=PATCH),
        projection_dim=24,
    )  # fmt: skip
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    tokenizer_config["pad_token"] = "<|endoftext|>"  # as CLIP's tokenizer pads
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    torch.manual_seed(seed)
    CLIPModel(config).save_pretrained(path)
    crop = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE}, crop_size=crop).save_pretrained(path)
    return path


def make_siglip(path: Path, seed: int = 0) -> Path:
    """SiglipModel (google/siglip-base-patch16-224's config, shrunk): bidirectional text tower
    pooling its last token through its head, vision tower pooled by its attention head."""
    from transformers import SiglipConfig, SiglipImageProcessorPil, SiglipModel

    _train_bpe(path, bos=None, eos="</s>")
    vocab = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]
    config = SiglipConfig(
        text_config=dict(**_TOWER, vocab_size=len(vocab), max_position_embeddings=64),
        vision_config=dict(**_TOWER, image_size=IMAGE_SIZE, patch_size=PATCH),
    )
    torch.manual_seed(seed)
    SiglipModel(config).save_pretrained(path)
    size = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    SiglipImageProcessorPil(size=size).save_pretrained(path)
    return path


NAFLEX_PATCHES = 16  # the tiny SigLIP2's position table: a 4 x 4 grid


def make_siglip2(path: Path, seed: int = 0, max_num_patches: int = NAFLEX_PATCHES) -> Path:
    """Siglip2Model (google/siglip2-base-patch16-naflex's config, shrunk): SigLIP's text
    tower, a NaFlex vision tower taking images at their own aspect ratio, up to
    ``max_num_patches`` patches of 8 pixels, its 4 x 4 position table resized to each."""
    from transformers import Siglip2Config, Siglip2ImageProcessorPil, Siglip2Model

    _train_bpe(path, bos=None, eos="</s>")
    vocab = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]
    config = Siglip2Config(
        text_config=dict(**_TOWER, vocab_size=len(vocab), max_position_embeddings=64),
        vision_config=dict(**_TOWER, num_patches=NAFLEX_PATCHES, patch_size=PATCH),
    )
    torch.manual_seed(seed)
    Siglip2Model(config).save_pretrained(path)
    Siglip2ImageProcessorPil(patch_size=PATCH, max_num_patches=max_num_patches).save_pretrained(
        path
    )
    return path


def sample_images() -> list:
    """PIL images of several sizes and modes (RGB, RGBA, L, P; portrait, landscape, smaller
    than the crop), random pixels from a fixed seed."""
    from PIL import Image

    rng = np.random.default_rng(0)
    shapes = [(40, 56, "RGB"), (70, 33, "RGBA"), (32, 32, "L"), (20, 25, "RGB"), (97, 64, "P")]
    images = []
    for h, w, mode in shapes:
        channels = {"RGB": 3, "RGBA": 4}.get(mode, 1)
        pixels = rng.integers(0, 256, (h, w, channels), dtype=np.uint8).squeeze(
            -1 if channels == 1 else ()
        )
        image = Image.fromarray(pixels, "L" if channels == 1 else mode)
        images.append(image.convert("P") if mode == "P" else image)
    return images


def png_bytes(image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def make_clip_st(clip: Path, path: Path) -> Path:
    """The tiny CLIP as sentence-transformers 6 saves it: one multimodal Transformer module
    (get_text_features / get_image_features), its processor in processor_config.json."""
    from sentence_transformers import SentenceTransformer

    SentenceTransformer(str(clip), device="cpu").save(str(path))
    return path


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height pixels (its data is one empty row)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0"))
