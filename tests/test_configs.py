"""Every shipped TOML (train_configs/, recipes/) parses with boost_titan's config and
names a registered model, flavor and valid [boost] options."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TOMLS = sorted(REPO.glob("train_configs/*.toml")) + sorted(REPO.glob("recipes/*.toml"))

_CHECK = """
import sys
from boost_titan.parallel import cpu_runtime
cpu_runtime.activate()
from boost_titan.train.config_check import parse_config
for path in sys.argv[1:]:
    cfg = parse_config(["--job.config_file", path])
    print(path, cfg.model.name, cfg.model.flavor, cfg.boost.tp_plan)
"""


def test_all_configs_parse():
    assert len(TOMLS) >= 15
    out = subprocess.run(
        [sys.executable, "-c", _CHECK, *map(str, TOMLS)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(out.stdout.strip().splitlines()) == len(TOMLS)


_PP2 = ["--parallelism.pipeline_parallel_degree", "2"]
_NO_LESS = [
    "--parallelism.pipeline_parallel_first_stage_less_layers",
    "0",
    "--parallelism.pipeline_parallel_last_stage_less_layers",
    "0",
]
_ZBV = ["--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"]

BAD = [
    (["--boost.tp_plan", "megatron"], "tp_plan = 'megatron' is not valid; choose one of"),
    (["--boost.rmsnorm", "fast"], "rmsnorm = 'fast' is not valid"),
    (
        ["--model.name", "gpt2"],
        "unknown model name 'gpt2'; boost_titan models: "
        "['cola_llama2', 'lax_llama2', 'llama2', 'svd_llama2']",
    ),
    (["--model.flavor", "9b"], "unknown flavor '9b' for model 'cola_llama2'; valid flavors:"),
    (
        ["--boost.latent_checkpoint", "full"],
        "latent_checkpoint = 'full' is not valid; choose one of",
    ),
    (
        ["--boost.latent_checkpoint_keep", "all"],
        "latent_checkpoint_keep = 'all' is not valid; choose one of",
    ),
    (
        [
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective_ac_option",
            "x",
        ],
        "selective_ac_option = 'x' is not valid",
    ),
    # pipeline splits and microbatching (debug model: 4 layers, local batch 4)
    (
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_microbatch_size",
            "3",
        ],
        "pipeline_parallel_microbatch_size = 3 does not divide training.local_batch_size = 4; "
        "valid microbatch sizes: [1, 2, 4]",
    ),
    (
        ["--parallelism.pipeline_parallel_degree", "4"],
        "4 pipeline stages (pipeline_parallel_degree 4 x 1 per rank for 1F1B) do not divide the 6 "
        "effective layers (4 layers + first_stage_less_layers 1 + last_stage_less_layers 1)",
    ),
    (
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "Interleaved1F1B",
        ],
        "4 pipeline stages (pipeline_parallel_degree 2 x 2 per rank for Interleaved1F1B) "
        "do not divide",
    ),
    (
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_layers_per_stage",
            "4",
        ],
        "pipeline_parallel_layers_per_stage = 4 does not divide the 6 effective layers",
    ),
    # stages per rank as torch 2.13 / torchtitan 0.2.2 place them (issue 29, defect 4):
    # V schedules exactly 2, other multi-stage schedules >= 2, single-stage exactly 1
    (
        [*_PP2, *_NO_LESS, *_ZBV, "--parallelism.pipeline_parallel_layers_per_stage", "2"],
        "layers_per_stage = 2 splits the 4 effective layers (4 layers + "
        "first_stage_less_layers 0 + last_stage_less_layers 0) into 2 stages, 1 per rank over "
        "pipeline_parallel_degree 2; the V schedule ZBVZeroBubble needs exactly 2 stages per "
        "rank; valid values for ZBVZeroBubble (exact split, exactly 2 stages per rank): [1]",
    ),
    (
        [*_PP2, *_ZBV, "--parallelism.pipeline_parallel_layers_per_stage", "1"],
        "into 6 stages, 3 per rank over pipeline_parallel_degree 2; the V schedule "
        "ZBVZeroBubble needs exactly 2 stages per rank; valid values for ZBVZeroBubble (exact "
        "split, exactly 2 stages per rank): [] (none: change the layer weights",
    ),
    (
        [
            *_PP2,
            *_NO_LESS,
            "--parallelism.pipeline_parallel_schedule",
            "Interleaved1F1B",
            "--parallelism.pipeline_parallel_layers_per_stage",
            "2",
        ],
        "into 2 stages, 1 per rank over pipeline_parallel_degree 2; the multi-stage schedule "
        "Interleaved1F1B needs at least 2 stages per rank; valid values for Interleaved1F1B "
        "(exact split, at least 2 stages per rank): [1]",
    ),
    (
        [
            *_PP2,
            *_NO_LESS,
            "--parallelism.pipeline_parallel_schedule",
            "GPipe",
            "--parallelism.pipeline_parallel_layers_per_stage",
            "1",
        ],
        "into 4 stages, 2 per rank over pipeline_parallel_degree 2; the single-stage schedule "
        "GPipe needs exactly 1 stage per rank; valid values for GPipe (exact split, exactly 1 "
        "stage per rank): [2]",
    ),
    # microbatch counts torch 2.13's schedules accept
    (
        [*_PP2, "--parallelism.pipeline_parallel_microbatch_size", "4"],
        "pipeline_parallel_microbatch_size = 4 gives 1 microbatches (training.local_batch_size "
        "4); pipeline_parallel_schedule '1F1B' needs at least 2 microbatches (one per stage); "
        "valid microbatch sizes: [1, 2]",
    ),
    (
        [
            *_PP2,
            *_NO_LESS,
            "--parallelism.pipeline_parallel_schedule",
            "DualPipeV",
            "--parallelism.pipeline_parallel_microbatch_size",
            "2",
        ],
        "pipeline_parallel_microbatch_size = 2 gives 2 microbatches (training.local_batch_size "
        "4); pipeline_parallel_schedule 'DualPipeV' needs at least 4 microbatches (one per "
        "stage); valid microbatch sizes: [1]",
    ),
    (
        [
            *_PP2,
            *_NO_LESS,
            "--parallelism.pipeline_parallel_schedule",
            "Interleaved1F1B",
            "--training.local_batch_size",
            "10",
            "--parallelism.pipeline_parallel_microbatch_size",
            "2",
        ],
        "gives 5 microbatches (training.local_batch_size 10); pipeline_parallel_schedule "
        "'Interleaved1F1B' needs a microbatch count that is a multiple of its rounds, "
        "max(1, count // pipeline_parallel_degree 2); valid microbatch sizes: [1, 5, 10]",
    ),
    # selective checkpointing under split-backward schedules (issue 29, defect 2)
    *[
        (
            [*_PP2, *_NO_LESS, "--parallelism.pipeline_parallel_schedule", schedule, *option],
            f"{refused} cannot be used with [parallelism] pipeline_parallel_schedule = "
            f"'{schedule}': that schedule splits each backward into an input pass and a weight "
            "pass",
        )
        for schedule, option, refused in (
            (
                "InterleavedZeroBubble",
                ["--boost.latent_checkpoint", "both"],
                "[boost] latent_checkpoint = 'both'",
            ),
            ("ZBVZeroBubble", ["--boost.latent_checkpoint", "mlp"], "latent_checkpoint = 'mlp'"),
            (
                "DualPipeV",
                ["--boost.latent_checkpoint", "attention"],
                "latent_checkpoint = 'attention'",
            ),
            (
                "InterleavedZeroBubble",
                [
                    "--activation_checkpoint.mode",
                    "selective",
                    "--activation_checkpoint.selective_ac_option",
                    "op",
                ],
                "[activation_checkpoint] selective_ac_option = 'op'",
            ),
        )
    ],
]

# [checkpoint] options (issues 28 and 31): the whole line, key, value and what is valid
_KEEP = (
    "is not valid: use 0 (keep every checkpoint) or >= 2 (one complete checkpoint is kept "
    "beside the newest save, which may still be being written under async_mode or hold only "
    "the model under last_save_model_only)"
)
_ENABLE = (
    "add --checkpoint.enable (the run then also saves checkpoints, every [checkpoint] "
    "interval steps and at the end, unless --checkpoint.load_only is added too)"
)
BAD += [
    (["--checkpoint.keep_latest_k", "1"], f"ValueError: [checkpoint] keep_latest_k = 1 {_KEEP}"),
    (["--checkpoint.keep_latest_k", "-1"], f"ValueError: [checkpoint] keep_latest_k = -1 {_KEEP}"),
    (
        ["--checkpoint.interval", "0"],
        "ValueError: [checkpoint] interval = 0 must be >= 1 (save every N steps)",
    ),
    (
        ["--checkpoint.interval", "-5"],
        "ValueError: [checkpoint] interval = -5 must be >= 1 (save every N steps)",
    ),
    (
        ["--checkpoint.load_step", "-2"],
        "ValueError: [checkpoint] load_step = -2 must be >= -1 (-1: the newest step)",
    ),
    # without --checkpoint.enable torchtitan ignores both: a fine-tuning run trained from
    # fresh weights (step-1 loss 9.50 instead of 6.67)
    (
        ["--checkpoint.initial_load_path", "outputs/imported/step-0"],
        "ValueError: [checkpoint] initial_load_path = 'outputs/imported/step-0' is ignored while "
        f"checkpointing is off (training would start from fresh weights): {_ENABLE}",
    ),
    (
        ["--checkpoint.load_step", "10"],
        f"ValueError: [checkpoint] load_step = 10 is ignored while checkpointing is off: {_ENABLE}",
    ),
]

# [compile] backend and [model] converters (issue 56): each was a traceback per rank at
# the first compiled call / at model build (157 and 137 lines on 2 ranks)
_CONVERTERS = ["quantize.grouped_mm.float8", "quantize.grouped_mm.mx", "quantize.linear.float8",
               "quantize.linear.mx"]  # fmt: skip
_DENSE = ["--model.name", "llama2", "--boost.tp_plan", "auto"]
BAD += [
    (
        ["--compile.enable", "--compile.backend", "bogus"],
        "ValueError: [compile] backend = 'bogus' is not a torch.compile backend (torch "
        f"{torch.__version__}); valid: cudagraphs, inductor, openxla, tvm (inductor: the "
        "default), or a debug one: aot_eager, ",
    ),
    (
        ["--model.converters", "float8"],
        "ValueError: [model] converters = ['float8'] names 'float8', which is not a model "
        f"converter of torchtitan; valid: {_CONVERTERS}; for 'float8' use one of "
        "['quantize.grouped_mm.float8', 'quantize.linear.float8']",
    ),
    (
        ["--model.converters", "quantize.linear.float8"],
        "ValueError: [model] converters = ['quantize.linear.float8'] names "
        "'quantize.linear.float8', which model 'cola_llama2' flavor 'debugmodel' cannot use: "
        "its blocks read the bottleneck factors' weights directly",
    ),
    (
        ["--model.converters", "quantize.grouped_mm.mx"],
        "ValueError: [model] converters = ['quantize.grouped_mm.mx'] names "
        "'quantize.grouped_mm.mx', which converts MoE experts' grouped GEMMs; model "
        "'cola_llama2' flavor 'debugmodel' has no experts (dense blocks): it would convert "
        "nothing",
    ),
    # a dense model would convert, but not on this CPU (the suite's machine)
    (
        [*_DENSE, "--model.converters", "quantize.linear.float8"],
        "ValueError: [model] converters = ['quantize.linear.float8'] names "
        "'quantize.linear.float8', which needs a CUDA GPU with float8 (compute capability "
        "8.9 or later: Ada, Hopper, Blackwell) and torchao; this machine has no CUDA GPU",
    ),
]

# what those rules still accept (each refused above when the rule is wrong)
GOOD = [
    [*_PP2, *_NO_LESS, *_ZBV, "--parallelism.pipeline_parallel_layers_per_stage", "1"],
    [*_PP2, *_NO_LESS, *_ZBV, "--activation_checkpoint.mode", "full"],
    [
        *_PP2,
        *_NO_LESS,
        "--parallelism.pipeline_parallel_schedule",
        "InterleavedZeroBubble",
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "1",
    ],
    [
        *_PP2,
        *_NO_LESS,
        "--parallelism.pipeline_parallel_schedule",
        "LoopedBFS",
        "--parallelism.pipeline_parallel_layers_per_stage",
        "1",
        "--boost.latent_checkpoint",
        "both",
    ],
    [*_PP2, "--parallelism.pipeline_parallel_microbatch_size", "2"],
    ["--compile.enable", "--compile.backend", "aot_eager"],
    [*_DENSE, "--compile.backend", "bogus"],  # not compiled: the backend is never read
]

_CHECK_BAD = """
import json, sys
from boost_titan.parallel import cpu_runtime
cpu_runtime.activate()
from boost_titan.train.launch_check import parse_launch_config
errors = []
for bad in json.loads(sys.argv[2]):
    try:  # parse_config and what this machine cannot run, as a launch checks
        parse_launch_config(["--job.config_file", sys.argv[1], *bad])
        errors.append(None)
    except BaseException as e:  # tyro exits with SystemExit on unparsable values
        errors.append(f"{type(e).__name__}: {e}")
print(json.dumps(errors))
"""


@pytest.fixture(scope="module")
def bad_config_errors():
    """The error of every BAD case, then None or the error of every GOOD case, from one
    interpreter (imports dominate the cost)."""
    import json

    out = subprocess.run(
        [
            sys.executable,
            "-c",
            _CHECK_BAD,
            str(REPO / "train_configs/debug_cola_btp_tp2.toml"),
            json.dumps([bad for bad, _ in BAD] + GOOD),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", range(len(BAD)), ids=[" ".join(b) for b, _ in BAD])
def test_bad_config_values_fail_early(bad_config_errors, case):
    bad, message = BAD[case]
    error = bad_config_errors[case]
    assert error is not None, f"{bad} was accepted"
    assert message in error, error


@pytest.mark.parametrize("case", range(len(GOOD)), ids=[" ".join(g) for g in GOOD])
def test_good_pipeline_configs_pass(bad_config_errors, case):
    assert bad_config_errors[len(BAD) + case] is None


@pytest.mark.parametrize("name, runs", [("cola_llama2", 1), ("llama2", 29)])
def test_only_dense_blocks_run_their_linear_modules(name, runs):
    """Why the linear quantizers are refused for low-rank models: a converter swaps
    nn.Linear modules for its own, whose forward does the cast, but a low-rank block
    reads its factors' weights with F.linear, so of its 57 nn.Linear modules only the
    output layer's forward runs (the dense model: all 29)."""
    from torchtitan.protocols.train_spec import _extra_train_specs

    from boost_titan.train import specs

    specs.register_all()
    spec = _extra_train_specs[name]
    args = spec.model_args["debugmodel"]
    model = spec.model_cls(args)
    ran = []
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.register_forward_hook(lambda *_: ran.append(1))
    with torch.no_grad():
        model.init_weights()
        model(torch.randint(0, args.vocab_size, (1, 8)))
    assert len(ran) == runs


def _pp_config(schedule: str, parts, micro: int = 1):
    from types import SimpleNamespace as NS

    return NS(
        parallelism=NS(
            pipeline_parallel_degree=2,
            pipeline_parallel_schedule=schedule,
            pipeline_parallel_microbatch_size=micro,
            pipeline_parallel_first_stage_less_layers=0,
            pipeline_parallel_last_stage_less_layers=0,
            pipeline_parallel_layers_per_stage=None,
            module_fqns_per_model_part=parts,
        ),
        training=NS(local_batch_size=4),
        boost=NS(latent_checkpoint="none"),
        activation_checkpoint=NS(mode="none", selective_ac_option="2"),
        compile=NS(enable=False, components=["model", "loss"]),
    )


def test_explicit_stage_lists_follow_the_schedules_stage_rule():
    """module_fqns_per_model_part: the stages per rank obey the same rule as the
    automatic split (V: exactly 2, multi-stage: >= 2, single-stage: exactly 1)."""
    from boost_titan.parallel.pipeline import check_pipeline_config, check_schedule_runs_here

    two = [["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", "output"]]
    four = [["tok_embeddings", "layers.0"], ["layers.1"], ["layers.2"], ["layers.3", "output"]]
    for schedule in ("1F1B", "GPipe"):
        check_pipeline_config(_pp_config(schedule, two), 4)
        with pytest.raises(ValueError, match=f"single-stage schedule {schedule} needs exactly 1"):
            check_pipeline_config(_pp_config(schedule, four), 4)
    for schedule in ("ZBVZeroBubble", "Interleaved1F1B", "InterleavedZeroBubble"):
        check_pipeline_config(_pp_config(schedule, four), 4)
    check_pipeline_config(_pp_config("DualPipeV", four), 4)  # parses (dry runs plan it)
    with pytest.raises(ValueError, match="'DualPipeV' needs a GPU"):  # but not on this CPU
        check_schedule_runs_here(_pp_config("DualPipeV", four))
    with pytest.raises(
        ValueError,
        match=r"module_fqns_per_model_part lists 2 stages, 1 per rank over "
        r"pipeline_parallel_degree 2; the V schedule ZBVZeroBubble needs exactly 2 stages per "
        r"rank \(list 4 stages\)",
    ):
        check_pipeline_config(_pp_config("ZBVZeroBubble", two), 4)
    with pytest.raises(ValueError, match="multi-stage schedule LoopedBFS needs at least 2"):
        check_pipeline_config(_pp_config("LoopedBFS", two), 4)
