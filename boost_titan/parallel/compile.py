"""torch.compile for boost_titan models: torchtitan's per-block compile, made exact.

Two torch 2.13 defects made compiled tensor-parallel runs silently wrong or crash;
both are contained here, for every plan (ours and torchtitan's full-rank one):

* **Cache keys without the rank.** AOTAutograd's cache key for a graph with DTensor
  inputs hashes the DTensor spec (mesh, placements, global shape) but not which rank
  traced it (pytorch/pytorch#188390; the upstream fix adds the CUDA device index,
  which is no help on CPU or across nodes sharing a cache folder). Loss-parallel
  cross-entropy bakes the rank's vocabulary offset into its graph, so on a warm cache
  every rank loaded one rank's graph: wrong losses with no error (LaX BTP TP2 step 1:
  16.75447 instead of 9.41918). :func:`use_rank_local_compile_cache` gives every rank
  its own cache folder.
* **Async collectives entering a compiled block.** ``RowwiseParallel`` (the vanilla
  and full-rank embeddings) returns its output as an ``AsyncCollectiveTensor``; passed
  into a compiled function, its autograd edge is lost or misrouted (backward crashed in
  ``Redistribute.backward`` with a plain tensor). :func:`apply_compile` waits for such
  inputs in eager, through an autograd-transparent identity, before each compiled
  block runs.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

_RANK_DIR_MARK = "BOOST_COMPILE_CACHE_RANK"


def use_rank_local_compile_cache() -> None:
    """Point inductor's caches (FX graphs, AOTAutograd, kernels) at
    ``<cache dir>/rank<R>`` in this process, so no rank ever loads another rank's
    graph. Keeps ``TORCHINDUCTOR_CACHE_DIR`` if set (as the base); idempotent."""
    if not torch.distributed.is_initialized():
        return
    rank = torch.distributed.get_rank()
    if os.environ.get(_RANK_DIR_MARK) == str(rank):
        return
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, f"rank{rank}")
    os.environ[_RANK_DIR_MARK] = str(rank)


class _WaitAsync(torch.autograd.Function):
    """Identity that waits for an async collective's result (plain tensor out); its
    backward passes the gradient through to the collective's autograd node."""

    @staticmethod
    def forward(ctx, t: AsyncCollectiveTensor) -> torch.Tensor:
        return t.trigger_wait().view_as(t.elem)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _wait_async_inputs(module, args, kwargs):
    if not any(isinstance(a, AsyncCollectiveTensor) for a in (*args, *kwargs.values())):
        return None
    wait = lambda a: _WaitAsync.apply(a) if isinstance(a, AsyncCollectiveTensor) else a  # noqa: E731
    return tuple(wait(a) for a in args), {k: wait(v) for k, v in kwargs.items()}


def apply_compile(model: nn.Module, compile_config) -> None:
    """torchtitan's per-block ``torch.compile`` (fullgraph), with async-collective
    inputs waited for before each compiled block."""
    from torchtitan.models.llama3.infra.parallelize import apply_compile as titan_apply_compile

    use_rank_local_compile_cache()
    titan_apply_compile(model, compile_config)
    for block in model.layers.values():
        if block is not None:
            block.register_forward_pre_hook(_wait_async_inputs, with_kwargs=True)


def check_backend(backend: str, option: str = "[compile] backend =") -> None:
    """``[compile] backend`` names a backend torch.compile knows (every one Dynamo
    lists, its debug and experimental ones and installed plugins included): a bad name
    otherwise surfaces at the first compiled call, as a traceback per rank and torchrun's
    report (157 lines, 4 tracebacks, for "bogus" on 2 ranks). ``option``: how the
    error names where the value came from."""
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        main = torch._dynamo.list_backends()  # less the debug and experimental ones
        debug = [b for b in known if b not in main and "TESTING" not in b]
        raise ValueError(
            f"{option} {backend!r} is not a torch.compile backend (torch "
            f"{torch.__version__}); valid: {', '.join(main)} (inductor: the default), or a "
            f"debug one: {', '.join(debug)} (aot_eager: no code generation)"
        )


def check_compile_config(config) -> None:
    """Refuse, when the config is parsed, a backend torch.compile does not know
    (:func:`check_backend`) and the compiled combinations torch 2.13 cannot run,
    naming what works instead.

    Both come from one torch 2.13 defect: when a compiled block recomputes a region
    that uses DTensor to_local/from_local, the partitioner saves the TP DeviceMesh
    for backward among the saved tensors, and the compiled forward fails at the first
    step ("expected all tensors_saved_with_vc_check to be Tensors ... DeviceMesh").
    Under latent checkpointing this happens only where attention itself is
    recomputed (keep = "none"); torchtitan's AC recomputes whole blocks."""
    compile_cfg, boost = config.compile, config.boost
    if compile_cfg.enable and compile_cfg.components:
        check_backend(compile_cfg.backend)
    tp = config.parallelism.tensor_parallel_degree
    if not (compile_cfg.enable and "model" in compile_cfg.components and tp > 1):
        return
    where = (
        "when compiled under tensor parallelism "
        f"(tensor_parallel_degree {tp}, torch {torch.__version__})"
    )
    if boost.latent_checkpoint in ("attention", "both") and boost.latent_checkpoint_keep == "none":
        raise ValueError(
            f"[boost] latent_checkpoint = {boost.latent_checkpoint!r} "
            f"with latent_checkpoint_keep = 'none' fails {where}; "
            "use latent_checkpoint_keep = 'attention' (the default), "
            "latent_checkpoint = 'mlp', or [compile] enable = false"
        )
    ac = config.activation_checkpoint.mode
    if ac != "none":
        raise ValueError(
            f"[activation_checkpoint] mode = {ac!r} fails {where}; with the btp plan use "
            "[boost] latent_checkpoint (compiles, and re-runs no collective), otherwise set "
            "[activation_checkpoint] mode = 'none' or [compile] enable = false"
        )
