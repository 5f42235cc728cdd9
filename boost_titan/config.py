"""The ``[boost]`` TOML section, and options added to torchtitan's ``[checkpoint]``,
``[fault_tolerance]``, ``[optimizer]`` and ``[training]``, merged into torchtitan's JobConfig.

``boost_titan.train`` merges it automatically; with plain ``torchtitan.train`` set
``[job] custom_config_module = "boost_titan.config"``.
"""

import argparse
import re
import sys
from dataclasses import dataclass, field
from typing import NoReturn

# Every valid choice, listed once: config validation, models, plans, planner, benchmark
# and error messages all read these.
LOW_RANK_TP_PLANS = ("btp", "vanilla")
TP_PLANS = ("auto", "fullrank", *LOW_RANK_TP_PLANS)
RMSNORM_MODES = ("online", "sync")
LAX_GATES = ("kron", "dense")
LATENT_ACTIVATIONS = ("silu", "none")
LATENT_ACTS = ("default", *LATENT_ACTIVATIONS)
# latent checkpointing mode -> the chunks of a block it recomputes in backward
LATENT_CHECKPOINT_CHUNKS = {
    "none": (),
    "attention": ("attention",),
    "mlp": ("mlp",),
    "both": ("attention", "mlp"),
}
LATENT_CHECKPOINT = tuple(LATENT_CHECKPOINT_CHUNKS)
LATENT_CHECKPOINT_KEEP = ("attention", "none")
# [parallelism] pipeline_parallel_schedule: torchtitan 0.2.2's schedules
PP_SCHEDULES = (
    "1F1B",
    "GPipe",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
# the schedules whose pipelines run under context parallelism, each tested against one
# process (tests/test_schedules.py: CP2 x PP2, losses and gradient norms over 3 steps);
# the others (and a schedule CSV) are refused with CP, for the reason below
CP_PP_SCHEDULES = tuple(s for s in PP_SCHEDULES if s != "DualPipeV")
CP_PP_REFUSED = {
    "DualPipeV": "DualPipeV runs only on GPUs (torch overlaps its forward and backward on "
    "accelerator streams) and CP under a pipeline is tested on CPU ranks; use ZBVZeroBubble, "
    "the same V-shaped stage placement",
}
NAN_POLICIES = ("stop", "skip")
OPTIMIZERS = ("Adam", "AdamW", "LORO")
LORO_REFRESH = ("all", "factors", "regular", "none")
LORO_EXACT_DTYPES = ("float64", "float32")


# A bad value is a plain ValueError (FileNotFoundError for a missing file or folder), as
# torchtitan's own and existing callers expect; the message carries the detail.
ConfigError = ValueError
ConfigPathError = FileNotFoundError


def bad(section: str, key: str, value, why: str, cls: type[Exception] = ValueError) -> Exception:
    """``[section] key = value <why>``: the one error format of every config check."""
    return cls(f"[{section}] {key} = {value!r} {why}")


# What a command prints when it refuses its input, every command alike (the boost-titan
# tools, the launch pre-check, the ranks' config check): one line, ``PROG: error:
# MESSAGE``, argparse's own form. The message alone, never the exception's class name:
# the user needs the key, the value and what is valid, not Python's type.
USAGE_ERROR_EXIT = 2  # argparse's


def refusal(prog: str, message: object) -> str:
    """The one line of a refusal (``message``: the text, or the exception that carries it)."""
    return f"{prog}: error: {str(message).strip()}"


def refuse(prog: str, message: object, code: int = USAGE_ERROR_EXIT) -> NoReturn:
    """:func:`refusal` on stderr, then exit ``code`` (a SystemExit: no traceback)."""
    print(refusal(prog, message), file=sys.stderr, flush=True)
    raise SystemExit(code)


# reST markup of the docstrings a help text is built from: ``x``, :mod:`x`, :func:`~x`
_MARKUP = re.compile(r"(?::[a-z]+:)?`{1,2}~?([^`]+?)`{1,2}")


def plain(text: str) -> str:
    """``text`` without reST markup (a docstring made a help text): literals and roles
    as their text, a literal block's ``::`` as one colon."""
    return re.sub(r"::(\s*)$", r":\1", _MARKUP.sub(r"\1", text), flags=re.MULTILINE)


class Parser(argparse.ArgumentParser):
    """argparse for every command: a usage error is one :func:`refusal` line (argparse's
    own prints the whole usage first: 13 lines for ``checkpoint from-dense``), naming
    the option and the bad value, then where the usage is; ``--help`` is plain text."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        refuse(self.prog, f"{message} ({self.prog} --help)")

    def format_help(self) -> str:
        return plain(super().format_help())


@dataclass
class Boost:
    tp_plan: str = "auto"
    """Tensor-parallel plan: "fullrank" (dense models, torchtitan's Megatron plan),
    "btp" (bottleneck-aware TP for low-rank models), "vanilla" (every factor its own
    Megatron chunk), or "auto" (fullrank for dense, btp for low-rank)."""

    rmsnorm: str = "online"
    """BTP only. "online": RMSNorm statistics ride in the next latent all-reduce;
    "sync": a separate all-reduce of the statistics (ablation)."""

    sequence_parallel: bool = False
    """BTP only: shard every [b, s, r] latent on the sequence between its A and its B
    (reduce-scatter after A instead of the all-reduce, all-gather before B), so each
    rank keeps 1/T of each latent's activations. Same forward volume; backward adds
    one all-gather per latent to rebuild B's input for its weight gradient (see
    sequence_parallel_keep_gathered). Needs rmsnorm = "online", seq_len divisible by
    the TP degree; not LaX (its latents cross blocks whole)."""

    sequence_parallel_keep_gathered: bool = False
    """With sequence_parallel: save each gathered [b, s, r] latent for B's weight
    gradient instead of all-gathering it again in backward (more memory, no extra
    collective)."""

    group_linears: bool = True
    """Concatenate A_q|A_k|A_v and A_gate|A_up into one GEMM (one all-reduce under
    BTP) and run B_q,B_k,B_v / B_gate,B_up as batched GEMMs."""

    rank: int = 0
    """Bottleneck rank r of every factored projection (0: the flavor's default)."""

    rank_ratio: float = 0.0
    """Alternative to ``rank``: r = round(rank_ratio * dim). 0 disables."""

    kv_rank: int = 0
    """Rank of the k/v projections (0: r for MHA, min(r, kv_dim // 2) for GQA)."""

    lax_gate: str = "kron"
    """LaX latent-crossing gate: "kron" (G1^T H G0, r = a*b) or "dense" (r x r)."""

    latent_act: str = "default"
    """Activation inside the bottleneck: "default" (the architecture's: SiLU for CoLA
    and LaX, none for SVD), "silu" or "none"."""

    latent_checkpoint: str = "none"
    """Communication-free low-rank activation checkpointing aligned with BTP chunks:
    keep only the reduced [b, s, r] latents (and the residual stream) and recompute
    the "attention" chunks (attention_norm + A_qkv, B_qkv -> attention -> A_o), the
    "mlp" chunks (B_o -> residual -> ffn_norm + A_gate|A_up, B_gate,B_up -> SwiGLU ->
    A_down), or "both" in backward, without any collective (with sequence_parallel a
    re-forwarded chunk all-gathers its latents again). Needs the btp plan (or no TP)
    with online RMSNorm, and replaces [activation_checkpoint] mode."""

    latent_checkpoint_every: int = 1
    """Apply latent checkpointing to every k-th block (block index % k == 0)."""

    latent_checkpoint_keep: str = "attention"
    """What a recomputed attention chunk keeps besides its inputs: "attention" keeps
    the attention kernel's output and log-sum-exp ([b, s, d/T] + [b, h/T, s] per
    block), so the re-forward skips attention, its costliest op; "none" keeps only
    the reduced latents and the residual shard."""

    rope_theta: float = 0.0
    """RoPE base frequency (0: the flavor's or the converted step's, LLaMA 2: 10000).
    Long context raises it so the slowest rotation spans the sequence (docs/training.md:
    "Longer sequences"); any model, dense or low-rank."""

    cpu_peak_flops: float = 0.0
    """Peak FLOP/s used for MFU on CPU runs (0: measure an fp32 matmul at start-up).
    `boost-titan peak-flops` prints this machine's figure."""

    nan_policy: str = "stop"
    """What a step whose loss or gradient norm is NaN/inf does. The update is never
    applied (no optimizer or LR-scheduler step). "stop": the run ends with an error
    naming the step, and no checkpoint is written after the last good one. "skip":
    the step is logged as skipped and training goes on with the next batch, up to
    ``nan_max_consecutive_skips`` skipped steps in a row, then it stops as "stop" does."""

    nan_max_consecutive_skips: int = 3
    """With nan_policy = "skip": consecutive non-finite steps tolerated before stopping."""

    log_comm: bool = False
    """Count tensor-parallel collectives (count and bytes, forward/backward) on the
    first training step and log them."""

    profile_freq: int = 100
    """Profile step 2 and every profile_freq-th step (``boost_titan.observability.step_profile``):
    forward/backward/optimizer time, tensor-parallel collective time, bytes and count,
    other and exposed communication, written to TensorBoard (time/, tp/, comm/) and the
    console, and the executed FLOPs behind the HFU. A profiled step costs about half a
    second more on the debug model (profiler stop and analysis, ``time/profiler_overhead_ms``)
    plus the profiler's per-op cost: ~1% of a run at 100, the debug configs use 10.
    0 disables."""


@dataclass
class Optimizer:
    """LORO's settings, merged into torchtitan's ``[optimizer]`` section (read only when
    ``name = "LORO"``). Defaults are the reference scripts' (mzf666/LORO-main)."""

    loro_freq: int = 500
    """K: every K-th optimizer step is an exact Riemannian step (QR, tangent-space
    projection, 2r x 2r SVD); the others are lazy (scaled Adam on the factors)."""

    loro_lr_scaler: float = -1.0
    """Learning-rate multiplier of the lazy factor steps; -1: r / d per factor pair."""

    loro_refresh: str = "all"
    """Adam states zeroed after each exact step: "all", "factors", "regular" or "none"."""

    loro_restart_warmup: int = 5
    """After each exact step the learning rate restarts near 0 and ramps back linearly
    over this many steps (the reference's cosine_restart warm-up); 0 disables."""

    loro_exact_dtype: str = "float64"
    """Precision of the exact step's QRs, solves and SVD: "float64" (exact to fp32
    rounding whatever the layout) or "float32" (the reference's: cheaper, W = B A within
    ~1e-6 relative of float64)."""


@dataclass
class Training:
    """Your own corpus' settings, merged into torchtitan's ``[training]`` section
    (``dataset = "local_text"``; ``boost_titan.data.local_text``)."""

    dataset_text_field: str = "text"
    """The field of each .jsonl/.json/.parquet document holding its text (also read by
    ``[validation] dataset = "local_text"``/``"local_text_holdout"``); .txt files are one
    document each."""

    dataset_holdout_files: int = 0
    """Hold the last N files (in path order) of ``dataset_path`` out of training; read
    them with ``[validation] dataset = "local_text_holdout"``. 0: no holdout."""

    dataset_holdout_every: int = 0
    """Hold the N-th, 2N-th, ... document of each file (1/N of the corpus) out of
    training, for ``[validation] dataset = "local_text_holdout"`` (a one-file corpus
    too). 0: none. Not with dataset_holdout_files."""

    dataset_blend: list[str] = field(default_factory=list)
    """With ``dataset = "tokenized"``: several tokenized corpora blended by weight, as
    ``["WEIGHT:PATH", ...]`` (e.g. ``["0.7:/data/web", "0.3:/data/code"]``; weights
    need not sum to 1). Empty: ``dataset_path`` alone. See boost_titan.data.order."""

    dataset_shuffle: bool = True
    """Train on the windows of each pass over a corpus in a seeded pseudo-random order
    (false: corpus order). Validation is never shuffled."""

    dataset_seed: int = 0
    """The seed of that shuffle (part of the saved data position)."""

    dataset_cache: str = ""
    """Where raw text (local_text, a saved dataset) is tokenized before training reads
    it; empty: $BOOST_TITAN_DATA_CACHE, else ~/.cache/boost_titan/tokenized."""


@dataclass
class Checkpoint:
    """boost_titan's options, merged into torchtitan's ``[checkpoint]`` section."""

    allow_foreign_steps: bool = False
    """Resume a step of the dump folder's checkpoint folder that another run saved (its
    manifest records another run id than the folder's ``run.json``: a step copied in
    from another run's folder). Off: such a step is set aside as ``step_N.corrupt``
    with a line saying whose it is, and an older step of this run resumed. To start
    from another run's step on purpose, use ``initial_load_path`` instead."""


@dataclass
class FaultTolerance:
    """boost_titan's options, merged into torchtitan's ``[fault_tolerance]`` section
    (``boost_titan.train.semi_sync``)."""

    sync_steps: int = 5
    """With ``semi_sync_method`` ("diloco" or "local_sgd"): the inner steps each replica
    group takes on its own between two synchronizations across the groups (DiLoCo's H;
    torchtitan's default). Not read without ``semi_sync_method``."""


@dataclass
class JobConfig:
    boost: Boost = field(default_factory=Boost)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    optimizer: Optimizer = field(default_factory=Optimizer)
    training: Training = field(default_factory=Training)


def validate_boost_config(boost: Boost) -> None:
    def _check(name: str, value: str, valid: tuple[str, ...]) -> None:
        if value not in valid:
            raise ValueError(
                f"[boost] {name} = {value!r} is not valid; choose one of {list(valid)}"
            )

    _check("tp_plan", boost.tp_plan, TP_PLANS)
    _check("rmsnorm", boost.rmsnorm, RMSNORM_MODES)
    _check("lax_gate", boost.lax_gate, LAX_GATES)
    _check("latent_act", boost.latent_act, LATENT_ACTS)
    _check("latent_checkpoint", boost.latent_checkpoint, LATENT_CHECKPOINT)
    _check("latent_checkpoint_keep", boost.latent_checkpoint_keep, LATENT_CHECKPOINT_KEEP)
    _check("nan_policy", boost.nan_policy, NAN_POLICIES)
    if boost.nan_max_consecutive_skips < 1:
        raise ValueError(
            f"[boost] nan_max_consecutive_skips = {boost.nan_max_consecutive_skips} must be >= 1"
        )
    if boost.profile_freq < 0:
        raise ValueError(
            f"[boost] profile_freq = {boost.profile_freq} must be >= 0 (0 disables profiling)"
        )
    if boost.latent_checkpoint_every < 1:
        raise ValueError(
            f"[boost] latent_checkpoint_every = {boost.latent_checkpoint_every} must be >= 1"
        )
    if not 0 <= boost.rope_theta < float("inf"):
        raise ValueError(
            f"[boost] rope_theta = {boost.rope_theta} must be a finite number > 0 "
            "(0: the model's own)"
        )
    if boost.rank < 0:
        raise ValueError(f"[boost] rank = {boost.rank} must be >= 0 (0 = flavor default)")
    if boost.kv_rank < 0:
        raise ValueError(f"[boost] kv_rank = {boost.kv_rank} must be >= 0")
    if boost.rank_ratio < 0 or boost.rank_ratio > 1:
        raise ValueError(f"[boost] rank_ratio = {boost.rank_ratio} must be in (0, 1] (0 disables)")
    if not boost.cpu_peak_flops >= 0 or boost.cpu_peak_flops == float("inf"):
        raise ValueError(
            f"[boost] cpu_peak_flops = {boost.cpu_peak_flops} must be a finite number >= 0 "
            "(0: measure at start-up)"
        )
    if boost.rank and boost.rank_ratio:
        raise ValueError(
            f"[boost] rank = {boost.rank} and rank_ratio = {boost.rank_ratio}: set either "
            "rank or rank_ratio, not both (the other 0)"
        )
