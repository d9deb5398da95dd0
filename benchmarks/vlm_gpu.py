"""Texts with images per second through a Qwen2-VL embedder: ``Engine.embed`` of dict inputs
(``{"text", "image"}``: chat formatting, decoding and preprocessing included) against
transformers' ``Qwen2VLModel`` on the processor's padded batches, last-token pooling, same
inputs, same process (issue 59; docs/images.md).

    python benchmarks/vlm_gpu.py --device cuda                        # Qwen2-VL-2B shape
    python benchmarks/vlm_gpu.py --shape tiny --device cpu --inputs 16

``qwen2-vl-2b``: Qwen/Qwen2-VL-2B-Instruct's sizes (configs/qwen2-vl-2b.json: a 28-layer
1536-wide decoder with M-RoPE sections 16/24/24, a 32-block 1280-wide vision tower of 14-pixel
patches merged 2 x 2) with random weights (seed 0), a small byte-level BPE tokenizer holding
Qwen2-VL's special tokens, the model's chat template and image processor settings; built once
under /tmp/pipepool-bench. Inputs: a JPEG of random smooth pixels (camera-like sizes, so a few
hundred image tokens each) and a query of 5-30 words, encoded before the clock. The peer
decodes with PIL and runs ``Qwen2VLProcessor`` (PIL image processor) on batches of
``--batch-size``, right-padded, and pools each row's last real token. Reported: inputs/s of
each (best of ``--passes``), the ratio, and the minimum cosine between the two sides' vectors.
"""

from __future__ import annotations

import argparse
import io
import json
import time
from pathlib import Path

import numpy as np
from images_gpu import bf16_rule_line, float32_only, make_images

HERE = Path(__file__).resolve().parent
CHECKPOINTS = Path("/tmp/pipepool-bench")
SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|image_pad|>", "<|video_pad|>",
]  # fmt: skip
# The chat template of Qwen2-VL-2B-Instruct's chat_template.json, images only.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY = dict(
    text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                      "mrope_section": [2, 3, 3]}),
    vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2,
                       patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
)  # fmt: skip
WORDS = [
    "a", "photo", "of", "the", "page", "with", "a", "chart", "table", "figure", "invoice",
    "receipt", "diagram", "map",
]  # fmt: skip


def build_checkpoint(shape: str) -> Path:
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    dest = CHECKPOINTS / f"{shape}-vlm"
    if (dest / "config.json").exists():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator([" ".join(WORDS), "You are a helpful assistant."], trainer)
    tok.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 32768,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
    }))  # fmt: skip
    ids = {t: tok.token_to_id(t) for t in SPECIALS}
    if shape == "tiny":
        raw = {**TINY, "text_config": {**TINY["text_config"], "vocab_size": 700}}
    else:
        raw = json.loads((HERE / "configs" / "qwen2-vl-2b.json").read_text())
        raw.pop("_source")
    raw.update(
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )  # fmt: skip
    config = transformers.Qwen2VLConfig(**raw)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.Qwen2VLForConditionalGeneration(config)
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(str(dest))
    del model
    transformers.Qwen2VLImageProcessorPil().save_pretrained(str(dest))
    (dest / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return dest


def make_inputs(count: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    images = make_images(count, seed)
    texts = [" ".join(rng.choice(WORDS, size=rng.integers(5, 31))) for _ in range(count)]
    return [{"text": t, "image": i} for t, i in zip(texts, images, strict=True)]


def run_engine(folder: Path, inputs: list[dict], args) -> tuple[float, np.ndarray]:
    import pipepool

    options = {"device": args.device}
    if args.device == "cuda":
        options["dtype"] = "bfloat16"
    with pipepool.Engine(str(folder), **options) as engine:
        engine.embed(inputs[:8], normalize=False)  # warm
        best, vectors = float("inf"), None
        for _ in range(args.passes):
            start = time.perf_counter()
            vectors = engine.embed(inputs, normalize=False)
            best = min(best, time.perf_counter() - start)
    return len(inputs) / best, np.asarray(vectors)


def load_peer(folder: Path, dtype, device: str, batch_size: int):
    """transformers' side: a function from inputs to their pooled vectors, in ``dtype``."""
    import torch
    import transformers
    from PIL import Image
    from transformers import processing_utils

    model = transformers.Qwen2VLModel.from_pretrained(str(folder), dtype=dtype)
    model = model.to(device).eval()
    # The processor without its video processor (transformers' needs torchvision).
    check = processing_utils.ProcessorMixin.check_argument_for_proper_class
    processing_utils.ProcessorMixin.check_argument_for_proper_class = (  # type: ignore[method-assign]
        lambda self, name, arg: (
            None if name == "video_processor" and arg is None else check(self, name, arg)
        )
    )
    try:
        processor = transformers.Qwen2VLProcessor(
            image_processor=transformers.Qwen2VLImageProcessorPil.from_pretrained(str(folder)),
            tokenizer=transformers.AutoTokenizer.from_pretrained(str(folder)),
            video_processor=None,
            chat_template=CHAT_TEMPLATE,
        )
    finally:
        processing_utils.ProcessorMixin.check_argument_for_proper_class = check  # type: ignore[method-assign]
    processor.tokenizer.padding_side = "right"

    def prompt(item: dict) -> str:
        content = [{"type": "image"}, {"type": "text", "text": item["text"]}]
        return processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )

    def vectors(inputs: list[dict]) -> np.ndarray:
        parts = []
        for i in range(0, len(inputs), batch_size):
            chunk = inputs[i : i + batch_size]
            images = [Image.open(io.BytesIO(item["image"])).convert("RGB") for item in chunk]
            batch = processor(
                text=[prompt(item) for item in chunk], images=images, padding=True,
                return_tensors="pt",
            ).to(device)  # fmt: skip
            with torch.inference_mode():
                hidden = model(**batch).last_hidden_state
            last = batch["attention_mask"].sum(1) - 1
            parts.append(hidden[torch.arange(len(chunk)), last].float().cpu().numpy())
        return np.concatenate(parts)

    return vectors


def run_transformers(folder: Path, inputs: list[dict], args) -> tuple[float, np.ndarray]:
    import torch

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    vectors = load_peer(folder, dtype, args.device, args.batch_size)
    vectors(inputs)  # warm (kernels, allocator)
    best, out = float("inf"), None
    for _ in range(args.passes):
        start = time.perf_counter()
        out = vectors(inputs)
        best = min(best, time.perf_counter() - start)
    return len(inputs) / best, out


def reference(folder: Path, inputs: list[dict], args) -> np.ndarray:
    """transformers in float32 (no TF32) on ``inputs``: docs/design.md §3's reference."""
    import torch

    with float32_only():
        return load_peer(folder, torch.float32, args.device, args.batch_size)(inputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=("qwen2-vl-2b", "tiny"), default="qwen2-vl-2b")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--inputs", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=16, help="the peer's batch")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument(
        "--reference", type=int, default=0, metavar="N",
        help="also judge the first N inputs by docs/design.md's bf16 rule against float32",
    )  # fmt: skip
    args = parser.parse_args()
    folder = build_checkpoint(args.shape)
    inputs = make_inputs(args.inputs, seed=0)
    print(f"{args.shape}, {args.inputs} text+image inputs, {args.device}, peer batch "
          f"{args.batch_size}")  # fmt: skip
    engine_rate, ours = run_engine(folder, inputs, args)
    peer_rate, theirs = run_transformers(folder, inputs, args)
    cos = (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    print(
        f"pipepool {engine_rate:,.1f} inputs/s | transformers {peer_rate:,.1f} inputs/s | "
        f"ratio {engine_rate / peer_rate:.2f}x | min cos {cos.min():.6f}"
    )
    if args.reference:
        n = args.reference
        print(bf16_rule_line(ours[:n], theirs[:n], reference(folder, inputs[:n], args)))


if __name__ == "__main__":
    main()
