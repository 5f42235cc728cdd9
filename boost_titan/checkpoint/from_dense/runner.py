"""The dense model run block by block on calibration tokens, capturing what each
projection of the block sees: the activation-aware fit's inputs and targets.

:class:`DenseRunner` holds the hidden states of every calibration token (fp32, on the
fit's device) and advances them through one dense block per :meth:`DenseRunner.step`,
returning the inputs of the block's projections: ``attention_norm(h)`` (q, k, v), the
attention output (o), ``ffn_norm(h')`` (gate, up) and ``silu(gate) * up`` (down).
The fit targets are the *dense* model's activations (each block's inputs come from the
dense blocks before it, not from already converted ones). The tokens:
:mod:`boost_titan.data.calibration`.
"""

from __future__ import annotations

import torch

from boost_titan.models.args import LlamaArgs
from boost_titan.models.model import DenseBlock, rope_freqs_cis

# the projections whose inputs a block run captures, by the module that sees them
CAPTURE = {
    "attention.wq": ("wq", "wk", "wv"),
    "attention.wo": ("wo",),
    "feed_forward.w1": ("w1", "w3"),
    "feed_forward.w2": ("w2",),
}


class DenseRunner:
    """The dense model's hidden states on the calibration tokens, one block at a time."""

    def __init__(
        self,
        args: LlamaArgs,
        embeddings: torch.Tensor,
        tokens: torch.Tensor,
        device: torch.device,
        chunk: int = 4,
    ):
        self.args, self.device, self.chunk = args, device, chunk
        self.h = torch.nn.functional.embedding(tokens.to(device), embeddings.to(device).float())
        self.freqs_cis = rope_freqs_cis(args, tokens.shape[1]).to(device)

    @property
    def tokens(self) -> int:
        return self.h.shape[0] * self.h.shape[1]

    @torch.no_grad()
    def step(self, i: int, block: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run block ``i`` (its dense tensors by block-relative name): the inputs of its
        projections, ``name -> [tokens, in]`` (q, k, v share one tensor, so do gate and
        up), and the hidden states move on to the next block."""
        with torch.device("meta"):
            blk = DenseBlock(i, self.args)
        blk.load_state_dict(
            {k: v.to(self.device, torch.float32) for k, v in block.items()}, assign=True
        )
        blk.eval()
        seen: dict[str, list[torch.Tensor]] = {k: [] for k in CAPTURE}
        hooks = []
        for path in CAPTURE:
            module = blk.get_submodule(path)

            def hook(_mod, inputs, path=path):
                seen[path].append(inputs[0].reshape(-1, inputs[0].shape[-1]))

            hooks.append(module.register_forward_pre_hook(hook))
        try:
            outs = [
                blk(self.h[s : s + self.chunk], self.freqs_cis)
                for s in range(0, self.h.shape[0], self.chunk)
            ]
        finally:
            for handle in hooks:
                handle.remove()
        self.h = torch.cat(outs)
        inputs = {}
        for path, projs in CAPTURE.items():
            x = torch.cat(seen[path])
            for p in projs:
                inputs[p] = x
        return inputs
