"""Layout search: the fastest layout that fits, for a model on N GPUs of a type.

    boost-titan search --model cola_llama2 --flavor 13b --gpus 32 \\
        --gpu h100-80 [--gpus-per-node 8] [--seq 4096] [--global-batch-tokens N] \\
        [--top K] [--write recipes/X.toml]

1. Enumerate: every TP (dividing the node) x CP x PP x data-parallel split of the GPUs
   (FSDP, or HSDP with the replicas across nodes; CP degrees only from
   ``layouts.CP_FROM_SEQ`` tokens, where a sequence's activations stop fitting beside
   TP alone: 16k), every plan of the model (low-rank:
   btp, btp with sequence-parallel latents, vanilla; dense: fullrank), micro-batch
   sizes 1/2/4/8 with the microbatches the global batch leaves, PP schedules 1F1B and
   Interleaved1F1B (2 stages per rank; GPipe has 1F1B's bubble and more memory, so it
   never wins), and the activation-memory choices of each plan (latent checkpointing
   none/mlp/attention/both for btp; none/full AC otherwise).
2. Rank all of them by the step-time model's tokens/s (:mod:`boost_titan.perf.step_time`,
   no tracing: microseconds each).
3. Walk the ranking from the top: each layout must pass the config checks the trainer
   runs (``check_config`` at the world size) and fit the GPU's memory less the dry
   run's headroom. Memory is the dry run's, split as it scales: one microbatch's
   activations per block and at the stack's ends are traced (FakeTensor, the dry
   run's ``trace_role``) once per (TP, plan, checkpointing, tokens per rank: CP holds
   ``seq / cp``) at micro-batch 1 in a 1- and a 2-layer model, and scaled by
   micro-batch, layers per stage and the schedule's microbatches in flight;
   parameters, gradients and AdamW states (fp32, 16 bytes per parameter) are divided
   by FSDP (over dp_shard x cp) analytically, plus FSDP's gathered bf16 parameters and
   one block's fp32 gradients. A 13B model's traces take seconds each;
   a search traces only the combinations its walk reaches.
4. The winner is checked with the full dry run (``boost_titan.perf.dryrun``: every pipeline
   rank traced at full size); if it does not fit there, the next one is.

One module a step: :mod:`.layouts` (1, and the recipe TOML of a layout),
:mod:`.memory` (the traces and estimates of 3), :mod:`.run` (2-4, the command's options
and output).
"""
