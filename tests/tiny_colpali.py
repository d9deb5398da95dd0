"""A tiny ColPali (vidore/colpali-v1.3-hf's layout: a PaliGemma of a SigLIP vision tower and a
Gemma decoder, shrunk) with random weights, written by transformers, with a small BPE tokenizer
holding PaliGemma's special tokens and its processor's config; and the transformers
reference."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tiny_models import REPRODUCER_PROMPTS, SENTENCES

_SPECIALS = ["<pad>", "<eos>", "<bos>", "<image>"]
IMAGE_SIZE, PATCH = 32, 8  # 16 image tokens a page


def make_colpali(path: Path, *, num_layers: int = 3, seed: int = 0) -> Path:
    """ColPaliForRetrieval over a PaliGemma of a 2-layer SigLIP vision tower (patch 8 on 32 x
    32 images) and a ``num_layers``-layer Gemma decoder (multi-query, as PaliGemma-3b's),
    projecting to 24 components; the folder as ColPaliProcessor saves it."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator([*SENTENCES, *REPRODUCER_PROMPTS], trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096,
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
    }))  # fmt: skip
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    image_processor = transformers.SiglipImageProcessorPil(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        image_seq_length=(IMAGE_SIZE // PATCH) ** 2,
    )
    processor = transformers.ColPaliProcessor(image_processor=image_processor, tokenizer=tokenizer)
    processor.save_pretrained(str(path))  # the tokenizer with the processor's added tokens
    vocab = len(processor.tokenizer)
    vlm = transformers.PaliGemmaConfig(
        text_config=dict(
            vocab_size=vocab + 3, hidden_size=64, intermediate_size=128,
            num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=1,
            head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6,
        ),
        vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            image_size=IMAGE_SIZE, patch_size=PATCH,
        ),
        image_token_index=processor.image_token_id, vocab_size=vocab + 3, projection_dim=64,
        hidden_size=64,
    )  # fmt: skip
    config = transformers.ColPaliConfig(vlm_config=vlm.to_dict(), embedding_dim=24)
    torch.manual_seed(seed)
    model = transformers.ColPaliForRetrieval(config).eval()
    with torch.no_grad():  # random norm weights: Gemma's are zeros (1 + w) at init
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.2)
    model.save_pretrained(str(path))
    return path


def colpali_reference(path: Path):
    """(ColPaliForRetrieval, ColPaliProcessor with the PIL image processor)."""
    import transformers

    model = transformers.ColPaliForRetrieval.from_pretrained(path).eval()
    processor = transformers.ColPaliProcessor.from_pretrained(path)
    return model, processor
