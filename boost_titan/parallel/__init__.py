"""Applying parallelism to a model, after the TP plan (``boost_titan.tp_plans``) says
where each tensor lives.

    parallelize        the train specs' parallelize_fn: TP plan, latent checkpointing,
                       then torchtitan's AC, compile and FSDP2/DDP (start here)
    latent_checkpoint  communication-free activation checkpointing of BTP chunk bodies
    compile            torch.compile made exact under TP (rank-local caches, async inputs)
    pipeline           PP: token-mean loss across microbatches, schedule checks
    cpu_runtime        torchtitan 0.2.2 on CPU/gloo; activate() before torchtitan loads
"""
