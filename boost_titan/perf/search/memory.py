"""A layout's memory per rank without tracing it whole: one microbatch's activations
per block and at the stack's ends, traced once per (TP, plan, checkpointing, sequence
per rank) in small models and scaled; parameters, gradients and optimizer states
analytically. Under CP a rank's activations are those of its ``seq / cp`` tokens (the
trace at that length; the dry run of a CP layout shows the same), plus the ring's
gathered K/V of one block while its attention runs."""

from __future__ import annotations

import math

from boost_titan.perf.search.layouts import BASE_RECIPE, BYTES_PARAM_GRAD_ADAM, ActTrace
from boost_titan.perf.step_time import Layout

# ---------------------------------------------------------------------------- memory


def trace_key(lay: Layout) -> tuple[int, str, str, int]:
    return (lay.tp, lay.plan, lay.checkpoint, lay.local_seq)


def _trace_worker(model: str, flavor: str, seq: int, tp: int, combos: list) -> dict:
    """In a forked process: one fake world of ``tp`` ranks, each (plan, checkpointing)
    traced at micro-batch 1 in a 1- and a 2-layer model (LaX: 2 and 3, as
    ``dryrun.plans``); the difference is one block's activations."""
    from boost_titan.parallel import cpu_runtime

    cpu_runtime.activate()
    import logging

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchtitan.tools.logging import logger

    from boost_titan.perf.dryrun.run import quiet_warnings
    from boost_titan.perf.dryrun.trace import _parallel_dims, trace_role
    from boost_titan.train.config_check import config_args, parse_config

    quiet_warnings()
    logger.setLevel(logging.ERROR)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    out = {}
    try:
        for plan, ckpt in combos:
            argv = [
                "--job.config_file", BASE_RECIPE,
                "--model.name", model, "--model.flavor", flavor,
                "--parallelism.tensor_parallel_degree", str(tp),
                "--parallelism.data_parallel_shard_degree", "1",
                "--training.local_batch_size", "1", "--training.seq_len", str(seq),
                "--training.dtype", "bfloat16", "--training.mixed_precision_param", "bfloat16",
                "--boost.tp_plan", "btp" if plan == "btp_sp" else plan,
            ]  # fmt: skip
            if plan == "btp_sp":
                argv.append("--boost.sequence_parallel")
            if ckpt == "full":
                argv += ["--activation_checkpoint.mode", "full"]
            elif ckpt != "none":
                argv += ["--boost.latent_checkpoint", ckpt]
            config = parse_config(argv, layout=False)
            config.compile.enable = False
            full = config_args(config)
            acts = []
            # LaX's first block has no crossing: its constant part needs 2 blocks
            layers = (2, 3) if full.arch == "lax" else (1, 2)
            for n in layers:
                rep = trace_role(
                    config,
                    _parallel_dims(config, tp),
                    fake=True,
                    args=full.with_overrides(n_layers=n),
                )
                acts.append(rep.activation_peak_bytes)
            per_block = acts[1] - acts[0]
            out[(plan, ckpt)] = (per_block, acts[0] - layers[0] * per_block)
    finally:
        dist.destroy_process_group()
    return out


def trace_pool():
    """Processes forked from one server that imported torch and torchtitan once (the
    dry run's pattern, ``dryrun.run.dry_run_many``): one fresh process per TP degree's
    traces (DTensor caches sharding decisions with the process group)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["boost_titan.perf.preload"])
    return ProcessPoolExecutor(1, mp_context=ctx, max_tasks_per_child=1)


def trace_activations(model: str, flavor: str, keys: set, pool) -> dict:
    """{trace_key: ActTrace}, one process of ``pool`` per (TP degree, sequence)."""
    groups: dict[tuple[int, int], list] = {}
    for tp, plan, ck, seq in sorted(keys):
        groups.setdefault((tp, seq), []).append((plan, ck))
    futures = {
        (tp, seq): pool.submit(_trace_worker, model, flavor, seq, tp, combos)
        for (tp, seq), combos in groups.items()
    }
    out = {}
    for (tp, seq), fut in futures.items():
        for (plan, ck), (pb, ends) in fut.result().items():
            out[(tp, plan, ck, seq)] = ActTrace(pb, ends)
    return out


def in_flight(lay: Layout) -> float:
    """Microbatches whose activations pipeline rank 0 holds at its peak, in units of
    one microbatch through all its stages (the dry run's rules: 1F1B ``min(n, p)``;
    Interleaved1F1B walks torch's order: its warm-up is ``2(p-1) + (v-1)p`` chunks
    plus the one in steady state, each chunk 1/v of the rank's layers)."""
    if lay.pp == 1:
        return 1.0
    if lay.schedule == "Interleaved1F1B":
        v = lay.stages_per_rank
        chunks = min(lay.microbatches * v, 2 * (lay.pp - 1) + (v - 1) * lay.pp + 1)
        return chunks / v
    return float(min(lay.microbatches, lay.pp))


def estimate_memory(args, lay: Layout, act: ActTrace) -> dict:
    """Bytes per rank of the fullest pipeline rank (see the module docstring)."""
    from boost_titan.perf.plan import params_per_rank
    from boost_titan.perf.step_time import block_plan_args

    a = block_plan_args(args, lay.plan)
    params_tp = params_per_rank(a, "btp" if lay.plan == "btp_sp" else lay.plan, lay.tp)
    ends = 2 * a.vocab_size * a.dim / lay.tp + a.dim
    block = (params_tp - ends) / a.n_layers
    layers = math.ceil(a.n_layers / lay.pp)
    stage_params = block * layers + (ends if lay.pp == 1 else ends / 2)
    static = BYTES_PARAM_GRAD_ADAM * stage_params / lay.fsdp  # CP ranks shard too
    if lay.fsdp * lay.dp_replicate == 1:
        gathered = 0.0
    elif lay.pp == 1:  # this block and the prefetched one in bf16, one block's fp32 grads
        gathered = block * (2 * 2 + 4)
    else:  # PP: parameters stay gathered through the step
        gathered = stage_params * 2 + block * 4
    mb = lay.micro_batch
    # backward's largest temporary: the loss's fp32 gradient of the (vocab-parallel)
    # logits, alive on the last stage while the traced activations are
    temporaries = mb * lay.local_seq * a.vocab_size / lay.tp * 4
    if lay.cp > 1:  # the ring's gathered K and V of the whole sequence, one block
        temporaries += mb * lay.seq * 2 * a.kv_dim / lay.tp * 2
    stage_act = act.per_block * layers
    if lay.pp == 1:
        activations = mb * (stage_act + act.ends)
    else:
        activations = mb * max(stage_act * in_flight(lay), stage_act + act.ends)
    return dict(
        params_grads_optimizer=static,
        fsdp_gathered=gathered,
        activations=activations,
        temporaries=temporaries,
        total=static + gathered + activations + temporaries,
    )
