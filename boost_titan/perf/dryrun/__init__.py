"""Dry run at full scale on CPU: does a config build, shard and fit at its world size?

    boost-titan dryrun --config recipes/cola_llama2_7b.toml --ngpu 8
    boost-titan dryrun --config X.toml --ngpu 32 --gpu-memory 80 --json [--key value ...]

For every distinct rank role (each pipeline rank; without PP all ranks are alike) the
run joins a fake process group of ``--ngpu`` ranks as a representative rank of that
role, builds the model on the meta device and applies the same ``parallelize_boost``
and torchtitan ``pipeline_llm`` a real run applies; then, under ``FakeTensorMode`` (no
memory, no compute), it allocates the local shards, builds torchtitan's optimizers and
traces one microbatch forward + backward per stage at full shape, twice with an
optimizer step between, under torch's ``MemTracker``. Per rank it reports:

* parameters, gradients, optimizer states: exact, the local shard bytes after a step;
* activations of one microbatch per stage: what ``MemTracker`` holds at the stage's
  peak (equals the bytes autograd saves, ``bench.activations``, on real ranks);
* activation peak: with PP, the schedule's microbatches in flight on this rank times
  each stage's activations (1F1B: ``min(n_mb, stages - s)``; GPipe: all; multi-stage
  schedules: walked from their action order, activations freed at full backward, or at
  the weight gradient when the schedule splits it);
* peak: the traced peak (parameters, gradients, optimizer states, all-gathered FSDP
  parameters, gradient temporaries and one microbatch's activations) plus the other
  in-flight microbatches' activations;
* TP bytes per step: the collectives on the TP mesh, counted while tracing, in
  all-reduce-equivalent bytes (``comm_stats.allreduce_equivalent``: an all-gather or
  reduce-scatter counts half its payload; the planner's and benchmark's convention),
  times the microbatches of a step.

Eager figures: ``[compile]`` is ignored here (compiled graphs may save less). Exit
code 1 when a role's peak exceeds ``--gpu-memory`` (GiB); 2 for a config that does not
parse.
"""

from boost_titan.perf.dryrun.report import GIB, RoleReport, budget_bytes, fits, format_reports
from boost_titan.perf.dryrun.run import dry_run, dry_run_role, measure, quiet_warnings
from boost_titan.perf.dryrun.trace import trace_role

__all__ = [
    "GIB",
    "RoleReport",
    "budget_bytes",
    "dry_run",
    "dry_run_role",
    "fits",
    "format_reports",
    "measure",
    "quiet_warnings",
    "trace_role",
]
