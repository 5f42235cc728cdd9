"""Pipeline parallelism for boost_titan models.

torchtitan's ``pipeline_llm`` splits and schedules the model; two things are ours:

* ``TokenMeanLoss``: torchtitan 0.2.2's schedules backpropagate each microbatch's loss
  as the loss function returns it, and its loss is a *sum* over tokens, so PP
  gradients come out ``global_valid_tokens`` times the non-PP ones (non-PP divides by
  the step's token count before backward). Clipping and Adam hide most of that, but
  grad norms, max_norm and SGD-like optimizers do not. Inside
  ``normalized_by(global_valid_tokens)`` each microbatch loss is divided by the step's
  global token count before backward, exactly as the non-PP path does;
  outside it (validation's ``eval()``) it is the plain sum torchtitan's validator
  expects.
* ``check_pipeline_config``: the stage split and the microbatching are checked when
  the config is parsed, before any weight is allocated, with the numbers in the error.
"""

from __future__ import annotations

import contextlib

import torch
from torchtitan.components.loss import build_cross_entropy_loss


class TokenMeanLoss:
    """A sum-reduced loss that divides by the step's global token count while
    ``normalized_by`` is active (pipeline training steps)."""

    def __init__(self, loss_sum_fn):
        self.loss_sum_fn = loss_sum_fn
        self._global_valid_tokens: torch.Tensor | None = None

    @contextlib.contextmanager
    def normalized_by(self, global_valid_tokens: torch.Tensor):
        self._global_valid_tokens = global_valid_tokens
        try:
            yield self
        finally:
            self._global_valid_tokens = None

    def __call__(self, pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss_sum = self.loss_sum_fn(pred, labels)
        if self._global_valid_tokens is None:
            return loss_sum
        return loss_sum / self._global_valid_tokens


def build_loss_fn(job_config, **kwargs) -> TokenMeanLoss:
    return TokenMeanLoss(build_cross_entropy_loss(job_config, **kwargs))


def pipeline_forward_backward(
    trainer, inputs, labels, extra_inputs, extra_kwargs, global_valid_tokens
):
    """One pipelined forward/backward over the local batch; returns
    ``local loss sum / global_valid_tokens`` like torchtitan's non-PP path (-1 on ranks
    without the last stage). The microbatch losses come back already normalised."""
    loss_fn: TokenMeanLoss = trainer.loss_fn
    schedule = trainer.pp_schedule
    targets, losses = (labels, []) if trainer.pp_has_last_stage else (None, None)
    with trainer.train_context(), loss_fn.normalized_by(global_valid_tokens):
        if trainer.pp_has_first_stage:
            schedule.step(
                inputs,
                **extra_inputs,
                **extra_kwargs,
                target=targets,
                losses=losses,
                return_outputs=False,
            )
        else:
            schedule.step(**extra_kwargs, target=targets, losses=losses, return_outputs=False)
    if not trainer.pp_has_last_stage:
        return torch.tensor([-1.0], device=trainer.device)
    # PP + FSDP can hand the losses back on the CPU (as in torchtitan)
    return torch.sum(torch.stack(losses)).to(trainer.device)


def _stages_per_rank(
    schedule: str,
    layers_per_stage: int | None,
    n_layers: int,
    first_less: int,
    last_less: int,
    pp: int,
) -> int:
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    single = issubclass(get_schedule_class(schedule), PipelineScheduleSingle)
    if layers_per_stage is None:
        return 1 if single else 2
    effective = n_layers + first_less + last_less
    if effective % layers_per_stage:
        valid = [
            k for k in range(1, effective + 1) if effective % k == 0 and (effective // k) % pp == 0
        ]
        raise ValueError(
            f"pipeline_parallel_layers_per_stage = {layers_per_stage} does not divide the "
            f"{effective} effective layers ({n_layers} layers + first_stage_less_layers "
            f"{first_less} + last_stage_less_layers {last_less}); valid values: {valid}"
        )
    return effective // layers_per_stage // pp


def check_pipeline_config(config, n_layers: int) -> None:
    """Clear, early errors for a pipeline split or microbatching that cannot work.

    The automatic split must be exact: the stage count (PP degree x stages per rank)
    must divide the effective layer count (layers + first/last_stage_less_layers, the
    weights torchtitan gives the embedding and the LM head). torchtitan would silently
    build unequal stages, and the slowest stage sets the pace of every step. An
    explicit ``module_fqns_per_model_part`` is taken as written, once checked to hold
    every layer exactly once, in order."""
    par = config.parallelism
    pp = par.pipeline_parallel_degree
    if pp <= 1:
        return
    batch, micro = config.training.local_batch_size, par.pipeline_parallel_microbatch_size
    if micro < 1 or batch % micro:
        raise ValueError(
            f"[parallelism] pipeline_parallel_microbatch_size = {micro} does not divide "
            f"training.local_batch_size = {batch}; valid microbatch sizes: "
            f"{[m for m in range(1, batch + 1) if batch % m == 0]}"
        )
    first_less = par.pipeline_parallel_first_stage_less_layers
    last_less = par.pipeline_parallel_last_stage_less_layers
    explicit = par.module_fqns_per_model_part
    if explicit:
        _check_explicit_split(explicit, n_layers, pp)
        return
    lps = par.pipeline_parallel_layers_per_stage
    if lps is not None:
        from torch.distributed.pipelining.schedules import (
            PipelineScheduleSingle,
            get_schedule_class,
        )

        effective = n_layers + first_less + last_less
        valid = [
            k for k in range(1, effective + 1) if effective % k == 0 and (effective // k) % pp == 0
        ]
        single = issubclass(
            get_schedule_class(par.pipeline_parallel_schedule), PipelineScheduleSingle
        )
        if single:
            valid = [k for k in valid if effective // k == pp]
        if lps not in valid:
            stage_note = (
                " (single-stage schedule " + par.pipeline_parallel_schedule + ")" if single else ""
            )
            raise ValueError(
                f"[parallelism] pipeline_parallel_layers_per_stage = {lps} does not divide the "
                f"{effective} effective layers ({n_layers} layers + first_stage_less_layers "
                f"{first_less} + last_stage_less_layers {last_less}) into "
                f"{'exactly one stage per rank' if single else 'a multiple of'} "
                f"pipeline_parallel_degree {pp}{stage_note}"
                f"; valid values: {valid}"
            )
    per_rank = _stages_per_rank(
        par.pipeline_parallel_schedule, lps, n_layers, first_less, last_less, pp
    )
    stages = pp * per_rank
    effective = n_layers + first_less + last_less
    if stages > effective or effective % stages:
        raise ValueError(
            f"{stages} pipeline stages (pipeline_parallel_degree {pp} x {per_rank} per rank for "
            f"{par.pipeline_parallel_schedule}) do not divide the {effective} effective layers "
            f"({n_layers} layers + first_stage_less_layers {first_less} + "
            f"last_stage_less_layers {last_less}); change those two weights so the sum is a "
            f"multiple of {stages}, set pipeline_parallel_layers_per_stage, or list the stages "
            f"in module_fqns_per_model_part ([parallelism] pipeline_parallel_degree = {pp}, "
            f"pipeline_parallel_schedule = {par.pipeline_parallel_schedule!r}, "
            f"pipeline_parallel_first_stage_less_layers = {first_less}, "
            f"pipeline_parallel_last_stage_less_layers = {last_less})"
        )
    per_stage = effective // stages
    if first_less > per_stage or last_less > per_stage:
        raise ValueError(
            f"[parallelism] pipeline_parallel_first_stage_less_layers = {first_less} / "
            f"pipeline_parallel_last_stage_less_layers = {last_less}: a stage's weight exceeds the "
            f"{per_stage} effective layers of each of the {stages} stages; valid: 0 .. {per_stage}"
        )


def _check_explicit_split(parts: list[list[str]], n_layers: int, pp: int) -> None:
    if len(parts) % pp:
        raise ValueError(
            f"module_fqns_per_model_part lists {len(parts)} stages, not a multiple of "
            f"pipeline_parallel_degree {pp}"
        )
    layers = [int(m.split(".")[1]) for part in parts for m in part if m.startswith("layers.")]
    if layers != list(range(n_layers)):
        raise ValueError(
            f"module_fqns_per_model_part must hold layers.0 .. layers.{n_layers - 1} exactly once "
            f"and in order; it holds layers {layers}"
        )
    for name, where in (("tok_embeddings", parts[0]), ("output", parts[-1])):
        if name not in where:
            raise ValueError(
                f"module_fqns_per_model_part: {name!r} must be in the "
                f"{'first' if name == 'tok_embeddings' else 'last'} stage"
            )
