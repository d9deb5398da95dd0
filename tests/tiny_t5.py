"""Tiny T5 encoders (sentence-t5 / gtr-t5 shapes, shrunk) with a T5-style tokenizer, and their
transformers reference."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from tiny_models import REPRODUCER_PROMPTS, SENTENCES

# The tiny shape every T5 test uses; the relative-position fields differ per variant, so both
# the defaults (32 buckets up to 128) and other values are read from config.json. n_positions
# (T5's trained length, 512 in real configs) is raised so that the small vocabulary's longest
# test prompt (602 tokens) runs whole, as transformers runs it.
_TINY = dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, n_positions=1024)
VARIANTS = {
    # sentence-t5 / gtr-t5: the original T5 feed-forward.
    "relu": dict(feed_forward_proj="relu"),
    # T5 v1.1 / flan-t5 encoders, with a coarser bias (fewer buckets, shorter reach) that the
    # longest prompts go beyond.
    "gated-gelu": dict(
        feed_forward_proj="gated-gelu",
        relative_attention_num_buckets=16,
        relative_attention_max_distance=40,
    ),
}


def train_t5_tokenizer(path: Path, vocab_size: int = 600) -> int:
    """T5's tokenizer, small: SentencePiece unigram with <pad> 0, </s> 1, <unk> 2, T5's
    pre-tokenizer (whitespace split, then "▁" prepended to every word), and "$A </s>": an EOS
    appended, nothing prepended. Returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
        ]
    )
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "</s>", "<unk>"],
        unk_token="<unk>",
        show_progress=False,
    )
    tok.train_from_iterator([*SENTENCES, *REPRODUCER_PROMPTS], trainer)
    assert [tok.token_to_id(t) for t in ("<pad>", "</s>", "<unk>")] == [0, 1, 2]
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "T5Tokenizer",
        "model_max_length": 512,
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        # The real vocabulary ends in 100 sentinel tokens; this small one has none.
        "extra_ids": 0,
        "additional_special_tokens": [],
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return tok.get_vocab_size()


def _randomise(model: torch.nn.Module) -> None:
    """T5's initialisation makes every norm weight 1 and the position bias small: make both
    matter (norm weights around 1, bias entries of order 1) so that a misplaced norm or bias
    shows in the outputs."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name:
                p.uniform_(0.5, 1.5)
            elif "relative_attention_bias" in name:
                p.normal_(0.0, 1.0)


def make_t5(
    path: Path, variant: str = "relu", *, architecture: str = "T5EncoderModel", seed: int = 0
) -> Path:
    """A tiny T5 of ``variant`` (VARIANTS) saved as ``architecture`` (T5EncoderModel, or
    T5ForConditionalGeneration with its decoder and LM head), with the T5 tokenizer."""
    import transformers

    vocab_size = train_t5_tokenizer(path)
    config = transformers.T5Config(
        vocab_size=vocab_size + 4, **_TINY, **VARIANTS[variant], architectures=[architecture]
    )
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).eval()
    _randomise(model)
    model.save_pretrained(str(path))
    return path


def make_sentence_t5(path: Path) -> Path:
    """A sentence-t5-shaped sentence-transformers folder: Transformer on a tiny T5 encoder,
    mean Pooling, Dense(64->32, Identity, no bias), Normalize. Its weights are stored as the
    hub's safetensors conversion of sentence-t5 stores them: the embedding as
    ``encoder.embed_tokens.weight`` and no ``shared.weight``."""
    from safetensors.torch import load_file, save_file
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules

    t5_dir = make_t5(path.with_name(path.name + "-transformer"))
    torch.manual_seed(1)
    st = SentenceTransformer(
        modules=[
            modules.Transformer(str(t5_dir), max_seq_length=256),
            modules.Pooling(64, pooling_mode="mean"),
            modules.Dense(64, 32, bias=False, activation_function=torch.nn.Identity()),
            modules.Normalize(),
        ],
        device="cpu",
    )
    st.save(str(path))
    weights = path / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["encoder.embed_tokens.weight"] = tensors.pop("shared.weight")
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return path


class T5Reference:
    """transformers' T5EncoderModel on the same folder (the encoder of any T5 checkpoint), fp32
    CPU, one prompt at a time."""

    def __init__(self, path: Path) -> None:
        import transformers

        self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
        self.model = transformers.T5EncoderModel.from_pretrained(
            str(path), dtype=torch.float32
        ).eval()

    def token_ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=True)["input_ids"]

    @torch.no_grad()
    def pooled(self, ids: list[int], pooling: str) -> np.ndarray:
        h = self.model(input_ids=torch.tensor([ids])).last_hidden_state[0].numpy()
        return {"mean": h.mean(0), "cls": h[0], "all": h}[pooling]
