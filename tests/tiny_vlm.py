"""A tiny Qwen2-VL (Qwen/Qwen2-VL-2B-Instruct's config, shrunk) with random weights, written by
transformers, with a small byte-level BPE tokenizer holding Qwen2-VL's vision tokens, the
model's chat template and its image processor config; and the transformers reference."""

from __future__ import annotations

import io
import json
import unicodedata
from pathlib import Path

import numpy as np
import torch
from tiny_models import REPRODUCER_PROMPTS, SENTENCES

# Qwen2-VL-2B-Instruct's chat template (its chat_template.json), as the processor renders it.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3-VL-Instruct's chat template (its chat_template.json), abridged: the tool branches, which
# no input here reaches, are left out; the system, user and assistant turns are as published.
QWEN3_VL_CHAT_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].content is string %}{{- messages[0].content }}{%- else %}"
    "{%- for content in messages[0].content %}{%- if 'text' in content %}{{- content.text }}"
    "{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- set image_count = namespace(value=0) %}{%- set video_count = namespace(value=0) %}"
    '{%- for message in messages %}{%- if message.role == "user" %}'
    "{{- '<|im_start|>' + message.role + '\\n' }}{%- if message.content is string %}"
    "{{- message.content }}{%- else %}{%- for content in message.content %}"
    "{%- if content.type == 'image' or 'image' in content or 'image_url' in content %}"
    "{%- set image_count.value = image_count.value + 1 %}"
    "{%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif content.type == 'video' or 'video' in content %}"
    "{%- set video_count.value = video_count.value + 1 %}"
    "{%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif 'text' in content %}{{- content.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- elif message.role == \"assistant\" %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}{%- if message.content is string %}"
    "{{- message.content }}{%- endif %}{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|image_pad|>", "<|video_pad|>",
]  # fmt: skip
PATCH, MERGE = 4, 2  # patch size, spatial merge size: one LLM token per 8 x 8 pixels


def write_tokenizer(path: Path) -> tuple[dict[str, int], int]:
    """A small byte-level BPE tokenizer holding Qwen's chat and vision tokens, in ``path``;
    returns the special tokens' ids and the vocabulary's size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700, special_tokens=_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator([*SENTENCES, *REPRODUCER_PROMPTS], trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
    }))  # fmt: skip
    return {t: tok.token_to_id(t) for t in _SPECIALS}, tok.get_vocab_size()


def make_qwen2_vl(
    path: Path, *, num_layers: int = 3, seed: int = 0, kind: str = "qwen2_vl"
) -> Path:
    """Qwen2VLForConditionalGeneration (``kind="qwen2_5_vl"``: Qwen2_5_VLForConditionalGeneration)
    with a 3-layer decoder (GQA, M-RoPE sections 2/3/3 of head_dim 16) and a
    vision tower of patch 4 and merge 2 (8-64 LLM tokens per image; Qwen2.5-VL's: three
    blocks, the middle one over the whole image, the others in windows of 2 x 2 merge
    blocks)."""
    import transformers

    ids, vocab = write_tokenizer(path)
    vision = dict(
        depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, patch_size=PATCH,
        spatial_merge_size=MERGE, temporal_patch_size=2, in_channels=3,
    )  # fmt: skip
    if kind == "qwen2_5_vl":
        vision = dict(
            depth=3, hidden_size=32, intermediate_size=48, out_hidden_size=64, num_heads=4,
            patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=2, in_channels=3,
            window_size=2 * PATCH * MERGE, fullatt_block_indexes=[1],
        )  # fmt: skip
    config_cls, model_cls = {
        "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration"),
        "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"),
    }[kind]
    config = getattr(transformers, config_cls)(
        text_config=dict(
            vocab_size=vocab + 2, hidden_size=64, intermediate_size=128,
            num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=4096, rms_norm_eps=1e-6, initializer_range=0.1,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                             "mrope_section": [2, 3, 3]},
        ),
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    getattr(transformers, model_cls)(config).eval().save_pretrained(str(path))
    factor = PATCH * MERGE
    transformers.Qwen2VLImageProcessorPil(
        patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2,
        min_pixels=8 * factor * factor, max_pixels=64 * factor * factor,
    ).save_pretrained(str(path))  # fmt: skip
    (path / "chat_template.jinja").write_text(QWEN2_VL_CHAT_TEMPLATE)
    return path


def make_qwen3_vl(path: Path, *, num_layers: int = 4, seed: int = 0) -> Path:
    """Qwen3VLForConditionalGeneration with a 4-layer Qwen3 decoder (GQA, q/k norms,
    interleaved M-RoPE sections 4/2/2 of head_dim 16) and a 3-block vision tower of patch 4
    and merge 2 (8-64 LLM tokens per image), a 4 x 4 learned position grid (interpolated to
    every image's grid) and DeepStack from all three blocks into decoder layers 0-2: at PP=2
    the second stage's first layer adds DeepStack rows the first stage sends it."""
    import transformers

    ids, vocab = write_tokenizer(path)
    config = transformers.Qwen3VLConfig(
        text_config=dict(
            vocab_size=vocab + 2, hidden_size=64, intermediate_size=128, head_dim=16,
            num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=4096, rms_norm_eps=1e-6, initializer_range=0.1,
            rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                             "mrope_section": [4, 2, 2], "mrope_interleaved": True},
        ),
        vision_config=dict(
            depth=3, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=64,
            patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=2, in_channels=3,
            num_position_embeddings=16, deepstack_visual_indexes=[0, 1, 2],
            initializer_range=0.1,
        ),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    transformers.Qwen3VLForConditionalGeneration(config).eval().save_pretrained(str(path))
    factor = PATCH * MERGE
    transformers.Qwen2VLImageProcessorPil(  # Qwen3-VL's checkpoints name this processor
        patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2, image_mean=[0.5] * 3,
        image_std=[0.5] * 3, min_pixels=8 * factor * factor, max_pixels=64 * factor * factor,
    ).save_pretrained(str(path))  # fmt: skip
    (path / "chat_template.jinja").write_text(QWEN3_VL_CHAT_TEMPLATE)
    return path


def reference(path: Path, kind: str = "qwen2_vl"):
    """(transformers' Qwen2VLModel, Qwen2_5_VLModel or Qwen3VLModel, its processor with the PIL
    image processor) of a tiny folder. The processor is built without a video processor
    (transformers' needs torchvision, which the test environment lacks; no input here is a
    video)."""
    import transformers
    from transformers import processing_utils

    model_cls, processor_cls = {
        "qwen2_vl": (transformers.Qwen2VLModel, transformers.Qwen2VLProcessor),
        "qwen2_5_vl": (transformers.Qwen2_5_VLModel, transformers.Qwen2_5_VLProcessor),
        "qwen3_vl": (transformers.Qwen3VLModel, transformers.Qwen3VLProcessor),
    }[kind]
    model = model_cls.from_pretrained(path).eval()
    check = processing_utils.ProcessorMixin.check_argument_for_proper_class
    processing_utils.ProcessorMixin.check_argument_for_proper_class = (  # type: ignore[method-assign]
        lambda self, name, arg: None if name == "video_processor" and arg is None
        else check(self, name, arg)
    )  # fmt: skip
    try:
        processor = processor_cls(
            image_processor=transformers.Qwen2VLImageProcessorPil.from_pretrained(path),
            tokenizer=transformers.AutoTokenizer.from_pretrained(path),
            video_processor=None, chat_template=(path / "chat_template.jinja").read_text(),
        )  # fmt: skip
    finally:
        processing_utils.ProcessorMixin.check_argument_for_proper_class = check  # type: ignore[method-assign]
    return model, processor


def reference_inputs(processor, item: dict) -> dict:
    """The processor's tensors for one dict input, formatted as pipepool formats it: one user
    message of its images then its text, with the generation prompt; an ``instruction`` as
    Qwen3-VL-Embedding's reference code (``Qwen3VLEmbedder.format_model_input``) writes it, a
    system message of it stripped, with a full stop unless it ends in punctuation."""
    from PIL import Image

    images = item.get("images", [item["image"]] if "image" in item else [])
    images = [Image.open(io.BytesIO(i)) if isinstance(i, bytes) else i for i in images]
    content = [{"type": "image"}] * len(images)
    if item.get("text"):
        content.append({"type": "text", "text": item["text"]})
    messages = [{"role": "user", "content": content}]
    if "instruction" in item:  # Qwen3-VL-Embedding's format_model_input
        instruction = item["instruction"].strip()
        if not unicodedata.category(instruction[-1]).startswith("P"):
            instruction += "."
        system = {"role": "system", "content": [{"type": "text", "text": instruction}]}
        messages.insert(0, system)
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return dict(processor(text=[text], images=images or None, return_tensors="pt"))


def reference_vectors(model, processor, items: list) -> np.ndarray:
    """transformers' last hidden state at each input's last token (dicts through the
    processor, strings tokenised as they are)."""
    out = []
    with torch.no_grad():
        for item in items:
            if isinstance(item, str):
                ids = processor.tokenizer(item, return_tensors="pt")["input_ids"]
                hidden = model(input_ids=ids).last_hidden_state
            else:
                hidden = model(**reference_inputs(processor, item)).last_hidden_state
            out.append(hidden[0, -1].numpy())
    return np.stack(out)


def make_colqwen2(vlm: Path, path: Path, *, seed: int = 0) -> Path:
    """ColQwen2ForRetrieval over the tiny Qwen2-VL's config (vidore/colqwen2-v1.0-hf's layout,
    shrunk), projecting to 24 components, with the same tokenizer and image processor."""
    import shutil

    import transformers

    config = transformers.ColQwen2Config(
        vlm_config=transformers.Qwen2VLConfig.from_pretrained(vlm).to_dict(), embedding_dim=24
    )
    torch.manual_seed(seed)
    transformers.ColQwen2ForRetrieval(config).eval().save_pretrained(str(path))
    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        shutil.copy(vlm / name, path / name)
    return path


def colqwen2_reference(path: Path):
    """(ColQwen2ForRetrieval, ColQwen2Processor with the PIL image processor)."""
    import transformers

    model = transformers.ColQwen2ForRetrieval.from_pretrained(path).eval()
    processor = transformers.ColQwen2Processor(
        image_processor=transformers.Qwen2VLImageProcessorPil.from_pretrained(path),
        tokenizer=transformers.AutoTokenizer.from_pretrained(path),
    )
    return model, processor


INSTRUCTED = [
    {"text": "a photo of a cat", "image": 0, "instruction": "Retrieve images of the query"},
    {"image": 2, "instruction": "  Represent the user's input. "},
    {"text": SENTENCES[1], "instruction": "Find the answer!"},
    {"images": [1, 4], "text": "two views", "instruction": "Represent the pair"},
]  # fmt: skip


def instructed_inputs() -> list[dict]:
    """``INSTRUCTED`` with its image indices as the sample images."""
    from tiny_towers import sample_images

    images = sample_images()
    out = []
    for item in INSTRUCTED:
        item = dict(item)  # a copy, the images in place of their indices
        if "image" in item:
            item["image"] = images[item["image"]]
        if "images" in item:
            item["images"] = [images[i] for i in item["images"]]
        out.append(item)
    return out
