"""Per-rank memory of each tensor-parallel plan, traced: the planner's memory figures
(``boost-titan plan``).

For a model (any ``LlamaArgs``) at TP degree ``tp`` alone (no FSDP, no PP), one
micro-batch of ``batch`` x ``seq`` tokens, weights, gradients, AdamW states and
activations all in ``dtype`` (torchtitan's ``training.dtype``), each plan is built and
traced as the dry run traces a config (``trace_role``: the trainer's
``parallelize_boost``, torchtitan's optimizers, forward + backward under
``FakeTensorMode`` and ``MemTracker``).

Every block of a model is the same, so the bytes are linear in the layer count: a
model of more than 3 layers is traced at 2 and 3 layers and extrapolated
(``f(L) = f(2) + (L - 2) (f(3) - f(2))``, exact; 2, not 1, so that LaX's first
block, which has no gate, is the constant term's). All traces run in one process
and one fake world of ``tp`` ranks: a fresh ``python -m boost_titan.perf.dryrun.plans``
(torchtitan must be imported after ``cpu_runtime.activate``, and DTensor caches what
it propagates with the process group), or the caller's own, for a command-line tool.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PlanMemory:
    """Bytes per rank: local parameter, gradient and optimizer-state shards after a
    step, and what one micro-batch's forward keeps for backward."""

    params: int
    grads: int
    optimizer: int
    activations: int
    # the saved bytes by block and role (``breakdown.ActivationBreakdown.to_json``)
    activation_breakdown: dict | None = None

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations


def _config(plan: str, tp: int, batch: int, seq: int, dtype: str, norm: str):
    """The JobConfig a TP-only run of ``plan`` would parse (the model itself is given
    to the trace as args, so name and flavor here are placeholders)."""
    from boost_titan.train.config_check import parse_config

    config = parse_config(
        [
            "--job.custom_config_module",
            "boost_titan.config",
            "--model.name",
            "llama2" if plan == "fullrank" else "cola_llama2",
            "--parallelism.tensor_parallel_degree",
            str(tp),
            "--parallelism.data_parallel_shard_degree",
            "1",
            "--training.local_batch_size",
            str(batch),
            "--training.seq_len",
            str(seq),
            "--training.dtype",
            dtype,
            # everything in dtype: no autocast to another one (TP-only layouts autocast
            # to mixed_precision_param, whose default is bfloat16)
            "--training.mixed_precision_param",
            dtype,
            "--boost.tp_plan",
            "btp" if plan == "btp_sp" else plan,
            *(["--boost.sequence_parallel"] if plan == "btp_sp" else []),
            "--boost.rmsnorm",
            norm,
            "--activation_checkpoint.mode",
            "none",  # torchtitan's default checkpoints every other block
            "--optimizer.name",
            "AdamW",
        ],
        layout=False,
    )
    config.compile.enable = False  # eager figures, as the dry run
    return config


def _trace(config, args) -> PlanMemory:
    from boost_titan.perf.dryrun.trace import _parallel_dims, trace_role

    tp = config.parallelism.tensor_parallel_degree
    rep = trace_role(config, _parallel_dims(config, tp), fake=True, args=args)
    return PlanMemory(
        rep.params_bytes,
        rep.grads_bytes,
        rep.optimizer_bytes,
        rep.activation_peak_bytes,
        rep.activation_breakdown,
    )


def _traced_layers(n_layers: int) -> tuple[int, ...]:
    return (2, 3) if n_layers > 3 else (n_layers,)


def _extrapolate(n_layers: int, traced: list[PlanMemory]) -> PlanMemory:
    if len(traced) == 1:
        return traced[0]
    two, three = traced
    return PlanMemory(
        *(
            a + (n_layers - 2) * (b - a)
            for a, b in zip(
                (two.params, two.grads, two.optimizer, two.activations),
                (three.params, three.grads, three.optimizer, three.activations),
            )
        ),
        _extrapolate_breakdown(n_layers, two.activation_breakdown, three.activation_breakdown),
    )


def _extrapolate_breakdown(n_layers: int, two: dict, three: dict) -> dict:
    """The same rule per role: the third block's bytes are every further block's."""
    from boost_titan.perf.dryrun.breakdown import ActivationBreakdown

    a, b = ActivationBreakdown.from_json(two), ActivationBreakdown.from_json(three)
    grow = lambda x, y: x + (n_layers - 2) * (y - x)  # noqa: E731
    return ActivationBreakdown(
        {k: grow(a.block_total[k], b.block_total[k]) for k in a.block_total},
        grow(a.stack_ends, b.stack_ends),
        n_layers,
    ).to_json()


def _trace_all(
    plan_args: dict[str, dict], tp: int, batch: int, seq: int, dtype: str, norm: str
) -> dict[str, PlanMemory]:
    """In this process: cpu_runtime first, then one fake world for every trace."""
    from boost_titan.parallel import cpu_runtime

    cpu_runtime.activate()
    import logging

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchtitan.tools.logging import logger

    from boost_titan.models.args import LlamaArgs
    from boost_titan.perf.dryrun.run import quiet_warnings

    quiet_warnings()
    # torchtitan's warnings about the placeholder config (no tokenizer: none is read)
    level = logger.level
    logger.setLevel(logging.ERROR)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        out = {}
        for plan, fields in plan_args.items():
            args = LlamaArgs(**{**fields, "max_seq_len": seq})  # as update_from_config sets it
            config = _config(plan, tp, batch, seq, dtype, norm)
            traced = [
                _trace(config, args.with_overrides(n_layers=n))
                for n in _traced_layers(args.n_layers)
            ]
            out[plan] = _extrapolate(args.n_layers, traced)
        return out
    finally:
        dist.destroy_process_group()
        logger.setLevel(level)


def trace_plans(
    plan_args: dict,
    tp: int,
    batch: int,
    seq: int,
    dtype: str,
    norm: str = "online",
    in_process: bool = False,
) -> dict[str, PlanMemory]:
    """``{plan: LlamaArgs}`` -> ``{plan: PlanMemory}`` per rank (see the module
    docstring), traced in a fresh ``python -m boost_titan.perf.dryrun.plans``, or with
    ``in_process`` in this process, which must have activated ``cpu_runtime`` before
    importing torchtitan and must hold no process group (a command-line tool: DTensor
    keeps what it traces cached with the process group)."""
    from dataclasses import asdict

    if not plan_args:
        return {}
    if in_process:
        return _trace_all(
            {plan: asdict(args) for plan, args in plan_args.items()}, tp, batch, seq, dtype, norm
        )
    import json
    import subprocess
    import sys

    request = {
        "plans": {plan: asdict(args) for plan, args in plan_args.items()},
        "tp": tp,
        "batch": batch,
        "seq": seq,
        "dtype": dtype,
        "norm": norm,
    }
    proc = subprocess.run(
        [sys.executable, "-m", "boost_titan.perf.dryrun.plans"],
        input=json.dumps(request),
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"tracing the plans failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.splitlines()[-1])
    return {plan: PlanMemory(**m) for plan, m in result.items()}


def main() -> None:
    """Read a ``trace_plans`` request on stdin; print the result as one JSON line."""
    import json
    import sys
    from dataclasses import asdict

    r = json.loads(sys.stdin.read())
    out = _trace_all(r["plans"], r["tp"], r["batch"], r["seq"], r["dtype"], r["norm"])
    print(json.dumps({plan: asdict(m) for plan, m in out.items()}))


if __name__ == "__main__":
    main()
