"""BTP composed with torchtitan's other dimensions, on 4 gloo ranks of the trainer:
TP2 x FSDP2, PP2 x TP2 (1F1B and Interleaved1F1B), PP2 x FSDP2 and HSDP, for CoLA,
SVD and LaX, with and without sequence-parallel latents. Each run starts from the same
seed checkpoint as a single-process run and its first steps' loss and gradient norm
must match that run's.

Data-parallel runs train on the single run's batches: the training data is one global
order of packed windows (``boost_titan.data.order``) whose global batch is local batch x
dp windows, so a run at dp degree ``dp`` with local batch ``4 / dp`` trains each step on
the single run's 4 windows, each rank on its own ``4 / dp`` of them. The gradient
reduced over the ranks must then equal the single-process one: an exact check of the
FSDP/HSDP reductions (each rank's gradient is a different part of the sum), not just
"the loss goes down".
"""

from __future__ import annotations

import pytest
from helpers import assert_safe_metadata, run_training

STEPS = 4  # = warmup_steps: the LR schedule is identical however long a run is
FP32 = ("--training.mixed_precision_param", "float32")
LOSS_RTOL = 2e-4  # measured: equal to the printed 5 decimals
# torch's fp32 vector_norm over ~2M gradient entries is itself off by ~3e-4 relative
# (the float64 norm of the same gradient sits between the TP and single-device
# figures), so grad norms of different layouts agree only to that
GRAD_NORM_RTOL = 1.5e-3

CP2 = ("--parallelism.context_parallel_degree", "2")
# arch, config, processes, data-parallel degree, extra overrides
LAYOUTS = [
    ("cola", "debug_cola_btp_tp2_fsdp2.toml", 4, 2, ()),
    # sequence-parallel latents under PP (and below, under FSDP2 with latent checkpointing)
    ("cola", "debug_cola_btp_tp2_pp2.toml", 4, 1, ("--boost.sequence_parallel",)),
    ("lax", "debug_cola_btp_tp2_pp2_interleaved.toml", 4, 1, ()),
    ("lax", "debug_lax_pp2_fsdp2.toml", 4, 2, ()),
    (
        "svd",
        "debug_cola_btp_tp2_fsdp2.toml",
        4,
        2,
        ("--boost.latent_checkpoint", "both", "--boost.sequence_parallel"),
    ),
    ("svd", "debug_svd_hsdp.toml", 4, 4, ()),
    # compiled (each block and the loss): the same numbers as the eager single process.
    # aot_eager: what these compose (compiled blocks under FSDP2's hooks, inside
    # pipeline stages, recomputed chunks) lives in Dynamo and AOTAutograd; inductor's
    # code for these blocks is checked by test_compile.py (a cold inductor build on 4
    # ranks costs 1.5-2.5 min here)
    (
        "cola",
        "debug_cola_btp_tp2_fsdp2.toml",
        4,
        2,
        ("--compile.enable", "--compile.backend", "aot_eager"),
    ),
    # context parallelism (ring attention) composed: with BTP TP2 and sequence-parallel
    # latents, under a pipeline, under FSDP2 (its shards span dp x cp); every block's
    # gradients against one process: tests/test_context_parallel.py
    ("cola", "debug_cola_btp_tp2.toml", 4, 1, (*CP2, "--boost.sequence_parallel")),
    ("lax", "debug_lax_pp2.toml", 4, 1, CP2),
    ("svd", "debug_svd_fsdp2.toml", 4, 2, CP2),
    (
        "lax",
        "debug_cola_btp_tp2_pp2.toml",
        4,
        1,
        (
            "--compile.enable",
            "--compile.backend",
            "aot_eager",
            "--boost.latent_checkpoint",
            "both",
        ),
    ),
]


@pytest.fixture(scope="module")
def docs_dir(corpus_dir, tmp_path_factory):
    """A dataset of 40 corpus documents."""
    from datasets import Dataset, load_from_disk

    docs = load_from_disk(str(corpus_dir / "train"))[:40]["text"]
    root = tmp_path_factory.mktemp("docs")
    Dataset.from_dict({"text": docs}).save_to_disk(str(root / "x1"))
    return root


class _References:
    """One single-process run per architecture from the shared seed checkpoint, made on
    first use."""

    def __init__(self, root, docs_dir, seed_checkpoint):
        self.root, self.docs_dir, self.runs = root, docs_dir, {}
        self.seed_checkpoint = seed_checkpoint

    def data(self, dp: int) -> tuple[str, ...]:
        """The single run's data and, at dp degree ``dp``, its global batch of 4 windows
        (base/debug.toml's local batch) as ``4 / dp`` per rank (pipeline micro-batches
        of 1)."""
        split = ()
        if dp > 1:
            split = (
                "--training.local_batch_size", str(4 // dp),
                "--parallelism.pipeline_parallel_microbatch_size", "1",
            )  # fmt: skip
        return (
            "--training.dataset",
            "local_text",
            "--training.dataset_path",
            str(self.docs_dir / "x1"),
            *split,
        )

    def get(self, arch: str):
        if arch not in self.runs:
            config = f"debug_{arch}.toml"
            load = (
                "--model.name",
                f"{arch}_llama2",
                "--checkpoint.enable",
                "--checkpoint.initial_load_path",
                str(self.seed_checkpoint(config)),
                "--checkpoint.interval",
                "1000",
                "--checkpoint.last_save_model_only",
                "--training.steps",
                str(STEPS),
                "--validation.no-enable",
                *FP32,
            )
            single = run_training(config, 1, self.root / f"{arch}_single", *load, *self.data(1))
            self.runs[arch] = (load, single)
        return self.runs[arch]


@pytest.fixture(scope="module")
def references(tmp_path_factory, docs_dir, seed_checkpoint):
    return _References(tmp_path_factory.mktemp("refs"), docs_dir, seed_checkpoint)


def _last_stage(run):
    """Loss/grad-norm series of a rank that computes the loss (PP: a last-stage rank;
    the others log -1, summed over data-parallel ranks)."""
    for rank in sorted(run.loss):
        if all(v > 0 for v in run.loss[rank].values()):
            return run.loss[rank], run.grad_norm[rank]
    raise AssertionError("no rank logged a loss")


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch,config,ngpu,dp,extra",
    LAYOUTS,
    ids=[
        f"{a}-{c.removesuffix('.toml')}"
        f"{'-compiled' if '--compile.enable' in e else ''}"
        f"{'-aot_eager' if 'aot_eager' in e else ''}"
        f"{'-ckpt' if '--boost.latent_checkpoint' in e else ''}"
        f"{'-sp' if '--boost.sequence_parallel' in e else ''}"
        f"{'-cp2' if CP2[0] in e else ''}"
        for a, c, _, _, e in LAYOUTS
    ],
)
def test_layout_matches_single_process(references, tmp_path, arch, config, ngpu, dp, extra):
    load, single = references.get(arch)
    run = run_training(config, ngpu, tmp_path / "run", *load, *references.data(dp), *extra)
    ref_loss, ref_norm = single.loss[0], single.grad_norm[0]
    loss, norm = _last_stage(run)
    print(f"{arch} {config}: single {ref_loss} {ref_norm}\n  layout {loss} {norm}")
    assert sorted(loss) == sorted(ref_loss) == list(range(1, STEPS + 1))
    for step in ref_loss:
        assert abs(loss[step] - ref_loss[step]) <= LOSS_RTOL * ref_loss[step], (
            step,
            loss,
            ref_loss,
        )
        # PP used to give grad norms x the step's token count (torchtitan 0.2.2)
        assert abs(norm[step] - ref_norm[step]) <= GRAD_NORM_RTOL * ref_norm[step], (
            step,
            norm,
            ref_norm,
        )
    assert loss[STEPS] < loss[1] - 0.3  # and it learns
    # its model-only last save (TP2 x FSDP2, PP2 x TP2, PP2 x FSDP2, HSDP) reads through
    # the allowlisted metadata reader
    assert_safe_metadata(run.dump_folder / "checkpoint" / f"step-{STEPS}")


BF16_STEPS = 10
# measured: max relative loss difference 1.9e-4 over 10 steps (bf16 vs fp32); 5x margin
BF16_LOSS_RTOL = 1e-3


# bf16 without FSDP: torchtitan trains TP- and PP-only layouts in fp32 whatever
# mixed_precision_param says; boost_titan autocasts their forward
# (parallelize.apply_autocast_without_fsdp). (config, processes, dp degree, overrides)
BF16_LAYOUTS = {
    "tp2 x fsdp2": ("debug_cola_btp_tp2_fsdp2.toml", 4, 2, ()),
    "tp2": ("debug_cola_btp_tp2.toml", 2, 1, ()),
    "pp2": (
        "debug_cola_btp_tp2_pp2.toml",
        2,
        1,
        ("--parallelism.tensor_parallel_degree", "1"),
    ),
}


@pytest.mark.slow
def test_bf16_mixed_precision_follows_fp32_in_every_layout(references, tmp_path):
    """bf16 mixed precision against the fp32 single process, 10 steps from the same seed
    checkpoint: BTP TP2 x FSDP2 (bf16 parameters and latents, fp32 gradient reduction)
    and the layouts without FSDP, TP2 and PP2 (bf16 autocast). Each must differ from
    fp32 (it really ran in bf16) by no more than bf16's tolerance, and the autocast
    layouts must agree with the FSDP path as closely."""
    load, _ = references.get("cola")
    steps = ("--training.steps", str(BF16_STEPS))
    single = run_training(
        "debug_cola.toml", 1, tmp_path / "fp32", *load, *steps, *references.data(1)
    )
    ref = single.loss[0]
    assert sorted(ref) == list(range(1, BF16_STEPS + 1))
    got = {}
    for name, (config, ngpu, dp, extra) in BF16_LAYOUTS.items():
        run = run_training(
            config,
            ngpu,
            tmp_path / name.replace(" ", ""),
            *load,
            *steps,
            *references.data(dp),
            "--training.mixed_precision_param",
            "bfloat16",
            *extra,
        )
        got[name], _ = _last_stage(run)
        assert sorted(got[name]) == sorted(ref), (name, got[name])
    print("fp32 single:", ref)
    fsdp = got["tp2 x fsdp2"]
    for name, loss in got.items():
        worst = max(abs(loss[s] - ref[s]) / ref[s] for s in ref)
        vs_fsdp = max(abs(loss[s] - fsdp[s]) / fsdp[s] for s in ref)
        print(
            f"bf16 {name}: {loss}\n  max relative difference vs fp32 {worst:.2e}, "
            f"vs bf16 tp2 x fsdp2 {vs_fsdp:.2e}"
        )
        assert 0 < worst <= BF16_LOSS_RTOL, name  # > 0: the run really was in bf16
        assert vs_fsdp <= BF16_LOSS_RTOL, name
