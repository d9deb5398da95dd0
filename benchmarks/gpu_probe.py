"""What the GPU's torch offers for varlen attention (run first on a new machine): does
varlen_attn take fewer KV heads than query heads without expansion (GQA), and how fast is
each way on a W1-like batch."""

from __future__ import annotations

import inspect

import torch
from torch.nn.attention.varlen import varlen_attn


def main() -> None:
    print("torch", torch.__version__, torch.cuda.get_device_name())
    print("varlen_attn signature:", inspect.signature(varlen_attn))
    gen = torch.Generator(device="cuda").manual_seed(0)
    lengths = torch.randint(16, 513, (64,), generator=gen, device="cuda")
    cu = torch.zeros(65, dtype=torch.int32, device="cuda")
    cu[1:] = torch.cumsum(lengths, 0)
    total, longest = int(cu[-1]), int(lengths.max())
    q = torch.randn(total, 16, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(total, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(total, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    ke, ve = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    ref = varlen_attn(q, ke, ve, cu, cu, longest, longest, window_size=(-1, 0))
    try:
        gqa = varlen_attn(q, k, v, cu, cu, longest, longest, window_size=(-1, 0))
        print("native GQA: max abs diff vs expanded", float((gqa - ref).abs().max()))
    except Exception as exc:
        print("native GQA refused:", type(exc).__name__, str(exc)[:200])
    from triton.testing import do_bench

    ms = do_bench(lambda: varlen_attn(q, ke, ve, cu, cu, longest, longest, window_size=(-1, 0)))
    ms_expand = do_bench(lambda: (k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)))
    print(f"varlen_attn {total} tokens: {ms:.3f} ms; expanding K/V: {ms_expand:.3f} ms")


if __name__ == "__main__":
    main()
