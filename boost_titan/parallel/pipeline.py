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

from boost_titan.config import bad


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


# What torch 2.13 and torchtitan 0.2.2 require of the stages per rank, by schedule class
# (torch.distributed.pipelining.schedules, torchtitan.distributed.pipeline_parallel):
# single-stage schedules (1F1B, GPipe) exactly 1 (pipeline_llm), the V schedules
# (ZBVZeroBubble, DualPipeV) exactly 2 (pipeline_module_split's "v schedules assume 2
# stages per rank"; the schedules' "ZBV requires exactly 2 stages per rank"), the other
# multi-stage ones (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble) at least 2
# (pipeline_llm's "Multi-stage schedule requires at least 2 stages per rank").
_STAGE_RULES = {
    "single": ("exactly 1 stage per rank", lambda n: n == 1),
    "v": ("exactly 2 stages per rank", lambda n: n == 2),
    "multi": ("at least 2 stages per rank", lambda n: n >= 2),
}


def _schedule_class(schedule: str):
    from torch.distributed.pipelining.schedules import get_schedule_class

    return get_schedule_class(schedule)


def schedule_kind(schedule: str) -> str:
    """``"single"``, ``"v"`` or ``"multi"``: how torchtitan places this schedule's stages."""
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleSingle,
        ScheduleDualPipeV,
        ScheduleZBVZeroBubble,
    )

    cls = _schedule_class(schedule)
    if issubclass(cls, PipelineScheduleSingle):
        return "single"
    return "v" if cls in (ScheduleZBVZeroBubble, ScheduleDualPipeV) else "multi"


def splits_backward(schedule: str) -> bool:
    """Whether the schedule runs backward in two passes over the same graph, one for the
    inputs' gradients (BACKWARD_INPUT) and one for the weights' (BACKWARD_WEIGHT): the
    zero-bubble schedules of torch 2.13 (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV)."""
    from torch.distributed.pipelining.schedules import (
        ScheduleDualPipeV,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    return _schedule_class(schedule) in (
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
        ScheduleDualPipeV,
    )


def _stage_rule(schedule: str) -> tuple[str, str, object]:
    kind = schedule_kind(schedule)
    text, ok = _STAGE_RULES[kind]
    label = {"single": "single-stage", "v": "V", "multi": "multi-stage"}[kind]
    return f"{label} schedule {schedule} needs {text}", text, ok


def _check_microbatches(schedule: str, n_micro: int, pp: int, per_rank: int, batch: int) -> None:
    """torch 2.13's microbatch-count rules: Schedule1F1B needs at least as many
    microbatches as stages; Interleaved1F1B and InterleavedZeroBubble a count that is a
    multiple of its rounds (max(1, n // pp)); DualPipeV at least as many as stages."""
    name = _schedule_class(schedule).__name__
    stages = pp * per_rank
    if name in ("Schedule1F1B", "ScheduleDualPipeV"):
        ok, rule = (lambda n: n >= stages), f"at least {stages} microbatches (one per stage)"
    elif name in ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble"):
        ok = lambda n: n % max(1, n // pp) == 0  # noqa: E731
        rule = (
            f"a microbatch count that is a multiple of its rounds, max(1, count // "
            f"pipeline_parallel_degree {pp})"
        )
    else:
        return
    if not ok(n_micro):
        valid = [m for m in range(1, batch + 1) if batch % m == 0 and ok(batch // m)]
        raise ValueError(
            f"[parallelism] pipeline_parallel_microbatch_size = {batch // n_micro} gives "
            f"{n_micro} microbatches (training.local_batch_size {batch}); "
            f"pipeline_parallel_schedule {schedule!r} needs {rule}; valid microbatch sizes: "
            f"{valid}" + ("" if valid else " (none: raise training.local_batch_size)")
        )


def _check_split_backward(config) -> None:
    """Selective activation checkpointing cannot run under a schedule that splits
    backward: its saved or recomputed values can be backpropagated once, and the
    weight pass is a second backward over the same region (torch raises "Trying to
    backward an extra time ... selective activation checkpoint" at step 1). Plain
    (non-selective) checkpointing recomputes per backward and trains."""
    schedule = config.parallelism.pipeline_parallel_schedule
    if not splits_backward(schedule):
        return
    why = (
        f"cannot be used with [parallelism] pipeline_parallel_schedule = {schedule!r}: that "
        "schedule splits each backward into an input pass and a weight pass over the same "
        "graph, and selective activation checkpointing can be backpropagated only once "
        "(torch fails at step 1: 'Trying to backward an extra time'); "
    )
    instead = "or a schedule without split backward: 1F1B, GPipe, Interleaved1F1B, LoopedBFS"
    if config.compile.enable and "model" in config.compile.components:
        raise ValueError(
            f"[compile] enable = true cannot be used with [parallelism] "
            f"pipeline_parallel_schedule = {schedule!r}: torch {torch.__version__} refuses "
            "compiled stage modules under schedules that split backward into input and "
            "weight passes ('not supported with stage modules that have used torch.compile', "
            "at the first step); set [compile] enable = false, " + instead
        )
    latent = config.boost.latent_checkpoint
    if latent != "none":
        raise bad(
            "boost",
            "latent_checkpoint",
            latent,
            why + "set latent_checkpoint = 'none' and use [activation_checkpoint] mode = "
            "'full' (or mode = 'selective' with a layer frequency, selective_ac_option = "
            "'1'), " + instead,
        )
    ac = config.activation_checkpoint
    if ac.mode == "selective" and ac.selective_ac_option == "op":
        raise bad(
            "activation_checkpoint",
            "selective_ac_option",
            "op",
            why + "use mode = 'full', or selective_ac_option = a layer frequency (e.g. "
            "'1': every block, fully recomputed), " + instead,
        )


def check_schedule_runs_here(config) -> None:
    """What this machine cannot run, checked where training starts (not when a config is
    parsed: the dry run plans GPU layouts on a CPU). DualPipeV: torch 2.13 runs its
    overlapped forward+backward on accelerator streams; on CPU it fails at the first
    step ('Accelerator expected')."""
    par = config.parallelism
    if (
        par.pipeline_parallel_degree > 1
        and par.pipeline_parallel_schedule == "DualPipeV"
        and torch.accelerator.current_accelerator() is None
    ):
        raise ValueError(
            "[parallelism] pipeline_parallel_schedule = 'DualPipeV' needs a GPU: torch "
            f"{torch.__version__} runs its overlapped forward+backward on accelerator "
            "streams (on CPU it fails at the first step: 'Accelerator expected'); on CPU use "
            "ZBVZeroBubble, the same V-shaped stage placement"
        )


def check_pipeline_config(config, n_layers: int) -> None:
    """Clear, early errors for a pipeline split or microbatching that cannot work.

    The automatic split must be exact: the stage count (PP degree x stages per rank)
    must divide the effective layer count (layers + first/last_stage_less_layers, the
    weights torchtitan gives the embedding and the LM head). torchtitan would silently
    build unequal stages, and the slowest stage sets the pace of every step. An
    explicit ``module_fqns_per_model_part`` is taken as written, once checked to hold
    every layer exactly once, in order. Either way the stages per rank must be what the
    schedule places (``_STAGE_RULES``), the microbatch count what it accepts, and
    selective checkpointing is refused under split-backward schedules."""
    par = config.parallelism
    pp = par.pipeline_parallel_degree
    if pp <= 1:
        return
    schedule = par.pipeline_parallel_schedule
    batch, micro = config.training.local_batch_size, par.pipeline_parallel_microbatch_size
    if micro < 1 or batch % micro:
        raise ValueError(
            f"[parallelism] pipeline_parallel_microbatch_size = {micro} does not divide "
            f"training.local_batch_size = {batch}; valid microbatch sizes: "
            f"{[m for m in range(1, batch + 1) if batch % m == 0]}"
        )
    _check_split_backward(config)
    needs, rule_text, rule_ok = _stage_rule(schedule)
    first_less = par.pipeline_parallel_first_stage_less_layers
    last_less = par.pipeline_parallel_last_stage_less_layers
    explicit = par.module_fqns_per_model_part
    if explicit:
        _check_explicit_split(explicit, n_layers, pp)
        per_rank = len(explicit) // pp
        if not rule_ok(per_rank):
            raise ValueError(
                f"[parallelism] module_fqns_per_model_part lists {len(explicit)} stages, "
                f"{per_rank} per rank over pipeline_parallel_degree {pp}; the {needs} "
                f"(list {pp if rule_text.startswith('exactly 1') else 2 * pp}"
                f"{'' if rule_text.startswith('exactly') else ' or more'} stages)"
            )
        _check_microbatches(schedule, batch // micro, pp, per_rank, batch)
        return
    effective = n_layers + first_less + last_less
    layers = (
        f"{effective} effective layers ({n_layers} layers + first_stage_less_layers "
        f"{first_less} + last_stage_less_layers {last_less})"
    )
    lps = par.pipeline_parallel_layers_per_stage
    if lps is not None:
        valid = [
            k
            for k in range(1, effective + 1)
            if effective % k == 0 and (effective // k) % pp == 0 and rule_ok(effective // k // pp)
        ]
        if lps not in valid:
            if effective % lps:
                why = f"does not divide the {layers}"
            elif (effective // lps) % pp:
                why = (
                    f"splits the {layers} into {effective // lps} stages, not a multiple of "
                    f"pipeline_parallel_degree {pp}"
                )
            else:
                why = (
                    f"splits the {layers} into {effective // lps} stages, "
                    f"{effective // lps // pp} per rank over pipeline_parallel_degree {pp}; "
                    f"the {needs}"
                )
            raise ValueError(
                f"[parallelism] pipeline_parallel_layers_per_stage = {lps} {why}; valid "
                f"values for {schedule} (exact split, {rule_text}): {valid}"
                + ("" if valid else " (none: change the layer weights, the degree or the schedule)")
            )
        per_rank = effective // lps // pp
    else:
        per_rank = 1 if schedule_kind(schedule) == "single" else 2
    stages = pp * per_rank
    if stages > effective or effective % stages:
        raise ValueError(
            f"{stages} pipeline stages (pipeline_parallel_degree {pp} x {per_rank} per rank for "
            f"{schedule}) do not divide the {layers}; change those two weights so the sum is a "
            f"multiple of {stages}, set pipeline_parallel_layers_per_stage, or list the stages "
            f"in module_fqns_per_model_part ([parallelism] pipeline_parallel_degree = {pp}, "
            f"pipeline_parallel_schedule = {schedule!r}, "
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
    _check_microbatches(schedule, batch // micro, pp, per_rank, batch)


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
