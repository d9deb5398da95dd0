"""Images/s of a dual encoder's vision tower: ``Engine.embed`` on encoded images (decoding and
preprocessing included) against transformers' batched ``get_image_features`` after its image
processor, same images, same process (issue 59; docs/images.md).

    python benchmarks/images_gpu.py --device cuda                     # CLIP ViT-B/16 shape
    python benchmarks/images_gpu.py --shape tiny --device cpu --images 64

``clip-b16``: transformers' ``CLIPConfig`` defaults (openai/clip-vit-base-patch32's sizes) with
16-pixel patches, as openai/clip-vit-base-patch16's config has; random weights (seed 0), built
once under /tmp/pipepool-bench. The images are JPEGs of random pixels at camera-like sizes,
encoded before the clock; both sides decode them (the peer with PIL in its loop, as a user's
script does, then ``CLIPImageProcessorPil``). Reported: images/s of each (best of
``--passes``), the ratio, and the minimum cosine between the two sides' vectors (bf16 on CUDA:
docs/design.md's bf16 rule applies).
"""

from __future__ import annotations

import argparse
import io
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

CHECKPOINTS = Path("/tmp/pipepool-bench")
SHAPES = {
    "clip-b16": dict(vision_config=dict(patch_size=16)),
    "tiny": dict(
        vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, patch_size=16),
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4),
        projection_dim=32,
    ),
}  # fmt: skip
SIZES = [(640, 480), (480, 640), (1024, 768), (800, 600), (512, 512)]


def build_checkpoint(shape: str) -> Path:
    """A CLIPModel folder of random weights with CLIP's image processor settings and a small
    BPE tokenizer (only images are embedded here; the text tower must still load)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel

    dest = CHECKPOINTS / f"{shape}-images"
    if (dest / "config.json").exists():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    bos, eos = "<|startoftext|>", "<|endoftext|>"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=[bos, eos], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(["a photo of a cat", "a photo of a dog on the grass"], trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0 {eos}:0",
        special_tokens=[(bos, tok.token_to_id(bos)), (eos, tok.token_to_id(eos))],
    )
    tok.save(str(dest / "tokenizer.json"))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos,
                        "eos_token": eos, "pad_token": eos, "model_max_length": 77}  # fmt: skip
    (dest / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    text = dict(SHAPES[shape].get("text_config", {}))
    text.update(bos_token_id=tok.token_to_id(bos), eos_token_id=tok.token_to_id(eos),
                pad_token_id=tok.token_to_id(eos))  # fmt: skip
    config = CLIPConfig(**{**SHAPES[shape], "text_config": text})
    torch.manual_seed(0)
    CLIPModel(config).save_pretrained(str(dest))
    CLIPImageProcessorPil().save_pretrained(str(dest))
    return dest


def make_images(count: int, seed: int) -> list[bytes]:
    """JPEGs of smooth random pixels (noise upsampled, so they compress like photos)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        width, height = SIZES[i % len(SIZES)]
        small = rng.integers(0, 256, (height // 16, width // 16, 3), dtype=np.uint8)
        image = Image.fromarray(small).resize((width, height), Image.Resampling.BILINEAR)
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=90)
        out.append(buffer.getvalue())
    return out


def run_engine(folder: Path, images: list[bytes], args) -> tuple[float, np.ndarray]:
    import pipepool

    options = {"device": args.device}
    if args.device == "cuda":
        options["dtype"] = "bfloat16"
    with pipepool.Engine(str(folder), **options) as engine:
        engine.embed(images[:32], normalize=False)  # warm
        best, vectors = float("inf"), None
        for _ in range(args.passes):
            start = time.perf_counter()
            vectors = engine.embed(images, normalize=False)
            best = min(best, time.perf_counter() - start)
    return len(images) / best, np.asarray(vectors)


def load_peer(folder: Path, dtype, device: str, batch_size: int):
    """transformers' side: a function from encoded images to their features, in ``dtype``."""
    import torch
    from PIL import Image
    from transformers import CLIPImageProcessorPil, CLIPModel

    model = CLIPModel.from_pretrained(str(folder), dtype=dtype).to(device).eval()
    # The PIL processor: the one transformers has without torchvision (the GPU machine has none),
    # and the one whose pixel values pipepool's preprocessing equals.
    processor = CLIPImageProcessorPil.from_pretrained(str(folder))

    def vectors(images: list[bytes]) -> np.ndarray:
        parts = []
        for i in range(0, len(images), batch_size):
            chunk = images[i : i + batch_size]
            batch = [Image.open(io.BytesIO(b)).convert("RGB") for b in chunk]
            pixels = processor(images=batch, return_tensors="pt")["pixel_values"]
            with torch.inference_mode():
                out = model.get_image_features(pixel_values=pixels.to(device, dtype))
            parts.append(getattr(out, "pooler_output", out).float().cpu().numpy())
        return np.concatenate(parts)

    return vectors


def run_transformers(folder: Path, images: list[bytes], args) -> tuple[float, np.ndarray]:
    import torch

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    vectors = load_peer(folder, dtype, args.device, args.batch_size)
    vectors(images[:32])  # warm
    best, out = float("inf"), None
    for _ in range(args.passes):
        start = time.perf_counter()
        out = vectors(images)
        if args.device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return len(images) / best, out


@contextmanager
def float32_only() -> Iterator[None]:
    """float32 products and convolutions in IEEE float32 (no TF32) inside, as a float32
    reference needs; the process's settings back after."""
    import torch

    saved = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved[0])
        torch.backends.cudnn.allow_tf32 = saved[1]


def bf16_rule_line(ours: np.ndarray, peer: np.ndarray, reference: np.ndarray) -> str:
    """docs/design.md §3 on these rows: pipepool's 16-bit error against the float32 reference
    beside transformers' own and the bound the rule allows, and how many rows keep to it."""
    from pipepool.parity.compare import allowed_error, cosine_rows

    ours_error = 1 - cosine_rows(ours, reference)
    peer_error = 1 - cosine_rows(peer, reference)
    allowed = allowed_error(peer, reference)
    kept = int((ours_error <= allowed).sum())
    return (
        f"bf16 rule on {len(reference)} inputs vs float32: {kept}/{len(reference)} within | "
        f"pipepool max 1-cos {ours_error.max():.2e} | transformers bf16 max 1-cos "
        f"{peer_error.max():.2e} | tightest margin {(allowed - ours_error).min():.2e}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="clip-b16")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--images", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=128, help="the peer's batch")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument(
        "--reference", type=int, default=0, metavar="N",
        help="also judge the first N images by docs/design.md's bf16 rule against float32",
    )  # fmt: skip
    args = parser.parse_args()
    folder = build_checkpoint(args.shape)
    images = make_images(args.images, seed=0)
    print(f"{args.shape}, {args.images} JPEGs, {args.device}, peer batch {args.batch_size}")
    engine_rate, ours = run_engine(folder, images, args)
    peer_rate, theirs = run_transformers(folder, images, args)
    cos = (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    print(
        f"pipepool {engine_rate:,.0f} images/s | transformers {peer_rate:,.0f} images/s | "
        f"ratio {engine_rate / peer_rate:.2f}x | min cos {cos.min():.6f}"
    )
    if args.reference:
        import torch

        n = args.reference
        with float32_only():
            ref = load_peer(folder, torch.float32, args.device, args.batch_size)(images[:n])
        print(bf16_rule_line(ours[:n], theirs[:n], ref))


if __name__ == "__main__":
    main()
