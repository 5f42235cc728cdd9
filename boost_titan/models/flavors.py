"""Model flavors: LLaMA-2 shapes (and CoLA's small sizes) for every architecture.

Ranks follow the papers: r = d/4, except CoLA's 130M (r = 256). GQA flavors give k/v
their own rank, at most kv_dim / 2.
"""

from __future__ import annotations

from dataclasses import replace

from .args import ARCHITECTURES, LlamaArgs

# [model] name -> architecture
MODEL_ARCH = {"llama2": "dense", "svd_llama2": "svd", "cola_llama2": "cola", "lax_llama2": "lax"}

DEBUG_VOCAB_SIZE = (
    8192  # = boost_titan.data.tokenizer.DEFAULT_VOCAB_SIZE, the embedded corpus' tokenizer
)

#            name           layers  dim  heads kv_heads  ffn    rank  vocab
_SHAPES = {
    "debugmodel": (4, 256, 8, None, 688, 64, DEBUG_VOCAB_SIZE),
    "debugmodel_gqa": (4, 256, 8, 4, 688, 64, DEBUG_VOCAB_SIZE),
    "60m": (8, 512, 8, None, 1376, 128, 32000),
    "130m": (12, 768, 12, None, 2048, 256, 32000),
    "350m": (24, 1024, 16, None, 2736, 256, 32000),
    "1b": (24, 2048, 32, None, 5472, 512, 32000),
    "3b": (28, 3072, 24, None, 8192, 768, 32000),
    "7b": (32, 4096, 32, None, 11008, 1024, 32000),
    "13b": (40, 5120, 40, None, 13824, 1280, 32000),
    "30b": (36, 8192, 64, None, 22016, 2048, 32000),
    "34b": (48, 8192, 64, 8, 22016, 2048, 32000),
}
FLAVORS = tuple(_SHAPES)

# CoLA keeps SwiGLU's outer SiLU only at its small sizes.
_COLA_KEEPS_SWIGLU = {"debugmodel", "debugmodel_gqa", "60m", "130m"}


def _base(name: str) -> LlamaArgs:
    layers, dim, heads, kv_heads, ffn, rank, vocab = _SHAPES[name]
    return LlamaArgs(
        dim=dim,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=kv_heads,
        ffn_dim=ffn,
        vocab_size=vocab,
        rank=rank,
    )


def flavors_for(arch: str) -> dict[str, LlamaArgs]:
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; valid: {list(ARCHITECTURES)}")
    table = {}
    for name in _SHAPES:
        args = _base(name)
        if arch == "dense":
            args = replace(args, rank=0)
        else:
            # low-rank reference code (CoLA, LaX) uses RMSNorm eps 1e-6
            args = replace(args, arch=arch, norm_eps=1e-6)
            if arch == "cola" and name not in _COLA_KEEPS_SWIGLU:
                args = replace(args, swiglu=False)
        table[name] = args
    return table
