"""The q/k row permutation between our RoPE and Hugging Face's.

Our attention (torchtitan's llama3) rotates *interleaved* pairs of a head's features:
(0, 1), (2, 3), ... as complex numbers. ``transformers``' LLaMA (and the CoLA authors'
copy of it) rotates *halves*: feature i pairs with i + head_dim/2 (``rotate_half``). The
same model in both conventions differs only in the order of each head's output rows of
q and k: within a head, HF row ``j * 2 + 0 / 1``-pairs become ``j`` / ``j + head_dim/2``.

These are torchtitan 0.2.2's ``Llama3StateDictAdapter._permute`` / ``_reverse_permute``
(Hugging Face's own conversion script), operation for operation, so both sides agree
bit for bit; they act on the output (row) dimension only, so they apply unchanged to a
low-rank projection's up-projection B ``[out, r]``. Only views, a transpose and a
reshape: a DTensor sharded on rows by whole heads (tensor parallel, FSDP) goes through
DTensor's own view rules, as it does in torchtitan's adapter.
"""

from __future__ import annotations

import torch


def to_rotate_half(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q or k projection ``[heads * head_dim, in]``: ours -> HF's (a copy)."""
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols).clone()


def from_rotate_half(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of :func:`to_rotate_half`: HF's rows -> ours."""
    rows, cols = w.shape
    return w.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)
