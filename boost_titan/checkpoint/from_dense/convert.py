"""Convert a dense model block by block (:class:`Converter`), on demand.

``Converter.get(fqn)`` returns one tensor of the low-rank model. Embeddings, the final
norm and the LM head are the dense model's (cast to float32). A block's tensors are made
when the first of them is asked for, in block order (block ``i`` needs the calibration
hidden states after block ``i - 1``), and each is dropped once handed out: asked for in
model order (what :mod:`boost_titan.checkpoint.from_dense.stream` does), memory holds one dense
block, its factors and its calibration inputs at a time.

Per projection of block ``i`` (``boost_titan.models.from_dense``): balanced SVD factors
at the target's rank; with calibration, the activation errors of those factors and, with
``fit``, the activation-aware fit (linear bottlenecks re-balanced after it); LaX blocks
``>= 1`` get a zero-contribution gate and the latent LayerNorm (fitted affine, or the
identity affine). The block norms are copied. The report (``Converter.report``) records,
per projection, the relative Frobenius error of the SVD factors (and the Eckart-Young
tail computed from the singular values), and with calibration the relative activation
error ``||Y - B latent(A X)|| / ||Y||`` on the calibration tokens (``plain``: the SVD
factors; ``refit``: ``B`` by least squares; ``fitted``) and on held-out sequences.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from boost_titan.checkpoint.from_dense.runner import DenseRunner
from boost_titan.checkpoint.from_dense.source import DenseSource, model_shapes
from boost_titan.models.args import LlamaArgs
from boost_titan.models.from_dense import (
    Latent,
    activation_error,
    balance,
    eckart_young_tail,
    fit_bottleneck,
    svd_factors,
    weight_error,
    zero_gate_tensors,
)
from boost_titan.models.model import ATTN_PROJS, PROJ_ORDER

_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclass
class Options:
    fit: bool = False  # the activation-aware fit (needs calibration tokens)
    fit_steps: int = 20  # L-BFGS iterations per projection
    device: torch.device = torch.device("cpu")
    svd_dtype: torch.dtype = torch.float64
    seed: int = 0  # the LaX Kronecker gates' G0
    heldout: int = 0  # calibration sequences held out of the fit, for the report


def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim  # glibc only
    except (OSError, AttributeError, TypeError):
        return None


_MALLOC_TRIM = _malloc_trim()


def _trim_heap() -> None:
    """Hand freed heap memory back to the OS (glibc's ``malloc_trim``; elsewhere a no-op).
    Between blocks the freed tensors of the last one are fragments of glibc's heap: at 1B
    the process grew ~30 MB per block without this (peak 1.5 -> 2.4 GiB over 24 blocks)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def projection_path(name: str) -> str:
    return f"attention.{name}" if name in ATTN_PROJS else f"feed_forward.{name}"


class Converter:
    def __init__(
        self,
        source: DenseSource,
        target: LlamaArgs,
        options: Options,
        tokens: torch.Tensor | None = None,
        on_projection: Callable[[int, str], None] | None = None,
    ):
        if options.fit and tokens is None:
            raise ValueError("the activation-aware fit needs calibration tokens")
        self.source, self.target, self.options = source, target, options
        self.shapes = model_shapes(target)
        self.on_projection = on_projection or (lambda i, name: None)
        self.runner: DenseRunner | None = None
        self.n_fit_tokens = 0
        if tokens is not None:
            embeddings = source.tensor("tok_embeddings.weight")
            self.runner = DenseRunner(source.args, embeddings, tokens, options.device)
            del embeddings
            n_seq, seq_len = tokens.shape
            held = options.heldout if n_seq > options.heldout else 0
            self.n_fit_tokens = (n_seq - held) * seq_len
        self.generator = torch.Generator().manual_seed(options.seed)
        self.next_layer = 0
        self.ready: dict[str, torch.Tensor] = {}
        self.report: dict[str, Any] = {
            "calibration_tokens": 0 if tokens is None else int(tokens.numel()),
            "fit_tokens": self.n_fit_tokens,
            "heldout_tokens": 0 if tokens is None else int(tokens.numel()) - self.n_fit_tokens,
            "layers": [],
        }

    # ------------------------------------------------------------------ tensors
    def get(self, fqn: str) -> torch.Tensor:
        """The low-rank model's tensor ``fqn`` (float32, CPU); each is handed out once."""
        if fqn not in self.shapes:
            raise KeyError(f"{fqn!r} is not a tensor of the target model")
        m = _LAYER.match(fqn)
        if m is None:
            return self.source.tensor(fqn).float().contiguous()
        while self.next_layer <= int(m[1]):
            self._convert(self.next_layer)
            self.next_layer += 1
        return self.ready.pop(fqn)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor at once (small models, tests)."""
        return {k: self.get(k) for k in self.shapes}

    # ------------------------------------------------------------------ one block
    def _convert(self, i: int) -> None:
        _trim_heap()
        t0 = time.perf_counter()
        target, opt = self.target, self.options
        block = self.source.block(i)
        inputs = self.runner.step(i, block) if self.runner is not None else None
        shapes = target.projection_shapes()
        lax_cross = target.arch == "lax" and i > 0
        latent = Latent(target.activation, norm=lax_cross, eps=target.lax_norm_eps)
        rows: dict[str, dict[str, float]] = {}
        made: dict[str, torch.Tensor] = {}
        for name in PROJ_ORDER:
            path = projection_path(name)
            w = block[f"{path}.weight"].to(opt.device, torch.float32)
            rank = shapes[name][2]
            fac = svd_factors(w, rank, opt.svd_dtype)
            row = {
                "rank": rank,
                "svd_rel_err": weight_error(w, fac.down, fac.up),
                "eckart_young_tail": eckart_young_tail(fac.singular_values, rank),
            }
            down, up, norm_w, norm_b = fac.down, fac.up, None, None
            if inputs is not None:
                down, up, norm_w, norm_b = self._calibrated(
                    name, w, inputs[name], fac.down, fac.up, latent, row
                )
            prefix = f"layers.{i}.{path}"
            made[f"{prefix}.down.weight"] = down.cpu()
            made[f"{prefix}.up.weight"] = up.cpu()
            if lax_cross:
                for k, v in zero_gate_tensors(target.lax_gate, rank, self.generator).items():
                    made[f"{prefix}.cross.gate.{k}"] = v
                made[f"{prefix}.cross.norm.weight"] = (
                    torch.ones(rank) if norm_w is None else norm_w.detach().cpu()
                )
                made[f"{prefix}.cross.norm.bias"] = (
                    torch.zeros(rank) if norm_b is None else norm_b.detach().cpu()
                )
            rows[name] = row
            del w, fac
            self.on_projection(i, name)
        for norm in ("attention_norm", "ffn_norm"):
            made[f"layers.{i}.{norm}.weight"] = block[f"{norm}.weight"].float().contiguous()
        want = {k: v for k, v in self.shapes.items() if k.startswith(f"layers.{i}.")}
        got = {k: tuple(v.shape) for k, v in made.items()}
        if got != want:  # a bug here, not a bad input
            raise RuntimeError(f"block {i}: made {sorted(set(got) ^ set(want))[:4]} wrongly")
        self.ready.update(made)
        self.report["layers"].append(
            {"layer": i, "seconds": round(time.perf_counter() - t0, 3), "projections": rows}
        )

    def _calibrated(self, name, w, x, down, up, latent: Latent, row: dict):
        """Activation errors and, with ``fit``, the fitted factors of one projection."""
        y = x @ w.t()
        if name == "w1" and not self.target.swiglu:
            # the target drops SwiGLU's outer SiLU: gate's bottleneck must give silu(W1 x)
            y = F.silu(y)
        n = self.n_fit_tokens
        x_fit, y_fit, x_held, y_held = x[:n], y[:n], x[n:], y[n:]
        ones = torch.ones(down.shape[0], device=x.device) if latent.norm else None
        zeros = torch.zeros(down.shape[0], device=x.device) if latent.norm else None
        held = x_held.shape[0] > 0
        if held:
            row["heldout_plain"] = activation_error(x_held, y_held, down, up, latent, ones, zeros)
        if not self.options.fit:
            row["act_plain"] = activation_error(x_fit, y_fit, down, up, latent, ones, zeros)
            return down, up, None, None
        fit = fit_bottleneck(x_fit, y_fit, down, up, latent, self.options.fit_steps)
        row.update(
            act_plain=fit.error_start,
            act_refit=fit.error_refit,
            act_fitted=fit.error_fitted,
            fit_evaluations=fit.evaluations,
        )
        down, up = fit.down, fit.up
        if latent.linear:
            down, up = balance(down, up)
            row["fitted_weight_rel_err"] = weight_error(w, down, up)
        if held:
            row["heldout_fitted"] = activation_error(
                x_held, y_held, down, up, latent, fit.norm_weight, fit.norm_bias
            )
        return down, up, fit.norm_weight, fit.norm_bias
