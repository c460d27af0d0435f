"""The transformers backend's prefill chunks by cuDNN (``chunk_attention``) against the Triton kernel's, on CUDA:
how far apart their logits are, against how far each is from the fp32 answer (the PyTorch references on an fp32
copy of the model) and how far a planted bug moves them (the chunk's own keys attended without the causal mask).
What tests/test_hf_backend.py's tolerance for the two paths is set from.

    python benchmarks/hf_chunk_attention_gpu.py OUTDIR      # writes OUTDIR/hf_chunk_attention.md

The model: of tests/test_hf_backend.py's shape (a 2-layer random Llama, head_dim 64, GQA 2), 384 distinct token
ids prefilled in chunks of 128 with TokenSelect k=32, n_init=4, n_local=32, dense_until=0 (the last two chunks select).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import transformers

import tokenselect.hf as tshf
from tokenselect.kernels import cudnn_attention

CHUNK, TOKENS = 128, 384
SETTINGS = dict(k=32, n_init=4, n_local=32, dense_until=0, theta=None)


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      bos_token_id=0, eos_token_id=1, pad_token_id=1, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.set_attn_implementation("tokenselect")
    return model


def logits(model, ids: torch.Tensor, **cache_args) -> torch.Tensor:
    cache = tshf.SelectionCache(**SETTINGS, **cache_args)
    with torch.no_grad():
        return torch.cat([model(ids[:, i:i + CHUNK], past_key_values=cache).logits
                          for i in range(0, ids.shape[1], CHUNK)], dim=1).float()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    ids = torch.randperm(510, generator=torch.Generator().manual_seed(18))[:TOKENS].add(2)[None].cuda()
    model = tiny_llama().cuda()
    exact = logits(model, ids, kernels="torch")  # fp32, the PyTorch references
    scale = exact.abs().max().item()
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        low = tiny_llama().to("cuda", dtype)
        triton = logits(low, ids, chunk_attention="triton")
        cudnn = logits(low, ids, chunk_attention="cudnn")
        real = cudnn_attention.cudnn_attention
        cudnn_attention.cudnn_attention = lambda q, k, v, causal, scale=None: real(q, k, v, False, scale)
        try:
            bug = logits(low, ids, chunk_attention="cudnn")
        finally:
            cudnn_attention.cudnn_attention = real

        def err(a, b):
            return (a - b).abs().max().item()
        rows.append(f"| {str(dtype).split('.')[-1]} | {err(cudnn, triton):.4f} | {err(triton, exact):.4f} | "
                    f"{err(cudnn, exact):.4f} | {err(bug, triton):.4f} |")
    text = "\n".join([
        "# The transformers backend's chunks by cuDNN against the Triton kernel",
        "",
        f"`python benchmarks/hf_chunk_attention_gpu.py OUTDIR` on {torch.cuda.get_device_name()}, torch "
        f"{torch.__version__}, transformers {transformers.__version__}. Max |difference| of the logits over "
        f"{TOKENS} positions (the largest fp32 logit: {scale:.3f}); the test's tolerance is 5% of the largest "
        f"Triton logit.",
        "",
        "| dtype | cuDNN - Triton | Triton - fp32 | cuDNN - fp32 | planted bug (own keys unmasked) - Triton |",
        "|---|---|---|---|---|",
        *rows,
    ])
    (args.out / "hf_chunk_attention.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
