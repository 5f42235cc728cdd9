"""boost_titan: bottleneck-aware tensor parallelism for low-rank LLaMA on torchtitan.

One folder per concern; each imports only the folders listed before it (the suite's
``tests/test_layers.py`` keeps it so). docs/source-tree.md is the map.

    config          the ``[boost]`` TOML section: every option, its valid choices, the error
                    format; every command's refusal line and argparse (``refuse``, ``Parser``)
    models/         the models: dense, SVD, CoLA, LaX LLaMA; flavors; bottleneck layers
    observability/  what a run reports: metrics, TensorBoard dashboard, step profile,
                    collective counts, log filters
    tp_plans/       tensor-parallel plans (BTP, vanilla, full-rank): placements and collectives
    optim/          optimizers: torchtitan's, and LORO
    parallel/       applying parallelism to a model: TP plan, latent checkpointing,
                    compile, FSDP2 (parallelize), pipeline, the CPU/gloo runtime
    checkpoint/     model state on disk: DCP steps (save, sealing, safe loading, disk
                    space, data position), exports to safetensors and Hugging Face (hf/)
    data/           where a batch comes from: datasets, your own corpus streamed, loaders,
                    tokenizers; the embedded corpus builder (corpus/)
    train/          a training job: config parsing and checks, train specs, the trainer,
                    faults, the launch pre-check
    perf/           speed and memory, predicted and measured: planner, step-time model,
                    layout search, dry run, recipes, benchmarks, GPU check
    cli/            the ``boost-titan`` command: every tool besides training

Importing the package stays light (no torch, no torchtitan): entry points activate the
CPU runtime before torchtitan loads, then register the train specs explicitly
(``boost_titan.train.specs.register_all``).
"""

__version__ = "0.1.0"
