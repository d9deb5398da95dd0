"""How far bf16 is from fp32 on a checkpoint, by transformers alone (no pipepool in the
loop): the floor any bf16 engine can reach against the fp32 reference. Uses the prompts of
``pipepool parity``."""

from __future__ import annotations

import argparse

import numpy as np
import torch
from transformers import AutoModel

from pipepool import Engine
from pipepool.parity.prompts import builtin_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    with Engine(args.model, device="cpu", max_model_len=args.max_model_len) as engine:
        limit = engine.info.max_model_len

        def count(text: str) -> int:
            ids = engine.tokenizer.encode_batch([text])[0]
            return len(ids)

        texts = builtin_prompts(count, limit)
        ids = engine.tokenize(texts)
    hidden = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModel.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
        with torch.inference_mode():
            hidden[dtype] = [
                model(input_ids=torch.as_tensor(t, device=args.device)[None]).last_hidden_state[0]
                .float().cpu().numpy()
                for t in ids
            ]  # fmt: skip
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    for pooling in ("last", "mean", "all"):
        worst = 1.0
        for a, b in zip(hidden[torch.float32], hidden[torch.bfloat16], strict=True):
            if pooling == "last":
                a, b = a[-1:], b[-1:]
            elif pooling == "mean":
                a, b = a.mean(0, keepdims=True), b.mean(0, keepdims=True)
            cos = (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
            worst = min(worst, float(cos.min()))
        print(f"transformers bf16 vs fp32, {pooling:4s}: worst per-request cosine {worst:.6f}")


if __name__ == "__main__":
    main()
