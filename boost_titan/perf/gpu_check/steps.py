"""Training steps as the trainer takes them (token-mean loss, AdamW), timed, and the
comparison of an eager and a compiled run: losses and gradients."""

from __future__ import annotations

import time

import torch

from boost_titan.perf.gpu_check.common import GRAD_RTOL, LOSS_RTOL


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def scalar(t: torch.Tensor) -> float:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).item()


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def plain_name(name: str) -> str:
    """Parameter names with torch.compile's wrapper level removed."""
    return name.replace("_orig_mod.", "")


def adamw(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)


def train_steps(
    model,
    opt,
    loss_fn,
    tokens,
    labels,
    steps: int,
    *,
    context=None,
    amp_dtype=None,
    keep_grads=False,
):
    """Steps with the trainer's token-mean loss; returns losses, per-step seconds and
    (``keep_grads``) the first step's local gradients by parameter name."""
    import contextlib

    device = tokens.device
    losses, times, grads = [], [], {}
    for i in range(steps):
        sync(device)
        t0 = time.perf_counter()
        with context() if context else contextlib.nullcontext():
            with (
                torch.autocast(device.type, dtype=amp_dtype)
                if amp_dtype
                else contextlib.nullcontext()
            ):
                loss = loss_fn(model(tokens), labels) / labels.numel()
            loss.backward()
        if keep_grads and i == 0:
            grads = {
                plain_name(n): local(p.grad).detach().clone() for n, p in model.named_parameters()
            }
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(scalar(loss.detach()))  # syncs, so the step time is the step's
        sync(device)
        times.append(time.perf_counter() - t0)
    return losses, times, grads


def compare(eager: tuple, compiled: tuple) -> dict:
    """Loss and gradient differences of two ``train_steps`` results."""
    (le, te, ge), (lc, tc, gc) = eager, compiled
    loss_rel = max(abs(c - e) / max(abs(e), 1e-30) for e, c in zip(le, lc))
    grad_rel = max(
        ((gc[n] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item() for n, g in ge.items()
    )
    return {
        "eager_loss": le,
        "compiled_loss": lc,
        "loss_max_rel_diff": loss_rel,
        "grad_max_rel_diff": grad_rel,
        "compile_step_s": tc[0],
        "eager_first_step_s": te[0],
        "ok": loss_rel <= LOSS_RTOL and grad_rel <= GRAD_RTOL,
    }
