"""Bad config values end in one clear error at parse time, naming the key; odd but valid
ones run. The cases below are what ``tests/config_fuzz.py`` found (each failed late,
deep inside torch/torchtitan, or with a message not naming the key, before the fix),
plus a short seeded fuzz batch. All parse cases run in ONE fresh interpreter
(torchtitan must be imported after boost_titan's CPU runtime)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import run_training

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.config_fuzz import Case  # noqa: E402  (plain dataclasses: no torchtitan import)

SEED, N_FUZZ = 20240612, 20

C, T = "debug_cola_btp_tp2.toml", "debug_cola.toml"
FT = [["fault_tolerance", "enable", True], ["fault_tolerance", "group_size", 2]]
# (case, expected category, substring of the outcome's message)
FIXED: list[tuple[Case, str, str]] = [
    # --- [parallelism]: torchtitan asserted inside ParallelDims, after the process group existed
    (
        Case(C, 3, "cli", []),
        "clean",
        "[parallelism] degrees multiply to 2 (data_parallel_replicate_degree 1 x "
        "data_parallel_shard_degree 1 x context_parallel_degree 1 x tensor_parallel_degree 2 x "
        "pipeline_parallel_degree 1) but WORLD_SIZE = 3",
    ),
    (
        Case(C, 2, "cli", [["parallelism", "tensor_parallel_degree", "0"]]),
        "clean",
        "[parallelism] tensor_parallel_degree = 0 must be >= 1",
    ),
    (
        Case(C, 2, "cli", [["parallelism", "data_parallel_shard_degree", "-2"]]),
        "clean",
        "[parallelism] data_parallel_shard_degree = -2 must be >= 1 "
        "(data_parallel_shard_degree may be -1",
    ),
    (
        Case(C, 3, "cli", [["parallelism", "data_parallel_shard_degree", "-1"]]),
        "clean",
        "[parallelism] data_parallel_shard_degree = -1 cannot fill WORLD_SIZE 3: "
        "the other degrees multiply to 2",
    ),
    # TP degree vs the model's dims: failed in parallelize_boost, after the mesh
    (
        Case(C, 3, "cli", [["parallelism", "tensor_parallel_degree", "3"]]),
        "clean",
        "[parallelism] tensor_parallel_degree 3 does not divide n_heads=8, n_kv_heads=8, "
        "dim=256, ffn_dim=688",
    ),
    (
        Case(C, 16, "cli", [["parallelism", "tensor_parallel_degree", "16"]]),
        "clean",
        "valid degrees [1, 2, 4, 8]",
    ),
    (
        Case(
            C,
            2,
            "cli",
            [
                ["parallelism", "context_parallel_degree", "2"],
                ["parallelism", "tensor_parallel_degree", "1"],
                ["training", "seq_len", "130"],
            ],
        ),
        "clean",
        "[training] seq_len = 130 must be divisible by 4 (2 x tensor_parallel_degree 1 x "
        "context_parallel_degree 2)",
    ),
    (
        Case(
            T,
            4,
            "cli",
            [
                ["parallelism", "data_parallel_replicate_degree", "2"],
                ["parallelism", "tensor_parallel_degree", "2"],
            ],
        ),
        "clean",
        "[parallelism] data_parallel_replicate_degree = 2 without sharding is plain DDP",
    ),
    (
        Case(
            "debug_lax_pp2.toml",
            2,
            "cli",
            [["parallelism", "pipeline_parallel_layers_per_stage", "2"]],
        ),
        "clean",
        "[parallelism] pipeline_parallel_layers_per_stage = 2 splits the 6 effective layers "
        "(4 layers + first_stage_less_layers 1 + last_stage_less_layers 1) into 3 stages, not a "
        "multiple of pipeline_parallel_degree 2; valid values for 1F1B (exact split, exactly 1 "
        "stage per rank): [3]",
    ),
    (
        Case(
            "debug_lax_pp2.toml", 2, "cli", [["parallelism", "pipeline_parallel_schedule", "Bogus"]]
        ),
        "clean",
        "[parallelism] pipeline_parallel_schedule = 'Bogus' is not valid; "
        "choose one of ['1F1B', 'GPipe'",
    ),
    (
        Case(
            "debug_lax_pp2.toml",
            2,
            "cli",
            [["parallelism", "pipeline_parallel_microbatch_size", "0"]],
        ),
        "clean",
        "[parallelism] pipeline_parallel_microbatch_size = 0 must be >= 1",
    ),
    (
        Case(
            "debug_lax_pp2.toml",
            2,
            "cli",
            [["parallelism", "pipeline_parallel_first_stage_less_layers", "0"]],
        ),
        "clean",
        "pipeline_parallel_first_stage_less_layers = 0, "
        "pipeline_parallel_last_stage_less_layers = 1)",
    ),
    # --- [training]
    (
        Case(C, 2, "cli", [["training", "seq_len", "30"]]),
        "clean",
        "[training] seq_len = 30 must be divisible by 4 (2 x tensor_parallel_degree 2",
    ),
    (
        Case(T, 1, "cli", [["training", "seq_len", "0"]]),
        "clean",
        "[training] seq_len = 0 must be >= 1",
    ),
    (
        Case(T, 1, "cli", [["training", "local_batch_size", "0"]]),
        "clean",
        "[training] local_batch_size = 0 must be >= 1",
    ),
    (
        Case(T, 1, "cli", [["training", "global_batch_size", "6"]]),
        "clean",
        "[training] global_batch_size = 6 must be a multiple of "
        "local_batch_size 4 x data-parallel degree 1",
    ),
    (
        Case(T, 1, "cli", [["training", "steps", "-1"]]),
        "clean",
        "[training] steps = -1 must be >= 1",
    ),
    (
        Case(T, 1, "cli", [["training", "max_norm", "-1"]]),
        "clean",
        "[training] max_norm = -1.0 must be a finite",
    ),
    (
        Case(T, 1, "cli", [["training", "dataset", "no_such_set"]]),
        "clean",
        "[training] dataset = 'no_such_set' is not a known dataset; valid: ['boost_corpus'",
    ),
    (
        Case(T, 1, "missing_corpus", [["training", "dataset_path", "/nonexistent/corpus"]]),
        "clean",
        "[training] dataset_path = '/nonexistent/corpus' reads '/nonexistent/corpus', "
        "which does not exist; build it with `boost-titan data build`",
    ),
    (
        Case(T, 1, "local_text_without_path", [["training", "dataset", "local_text"]]),
        "clean",
        "[training] dataset_path = None must be set for dataset 'local_text'",
    ),
    (
        Case(T, 1, "cli", [["training", "gc_freq", "0"]]),
        "clean",
        "[training] gc_freq = 0 must be >= 1",
    ),
    # wrong types in a TOML file: torchtitan took them as they were
    (
        Case(T, 1, "toml", [["training", "seq_len", "256"]]),
        "clean",
        "[training] seq_len = '256' has type str; expected int",
    ),
    (
        Case(C, 2, "toml", [["parallelism", "tensor_parallel_degree", 2.0]]),
        "clean",
        "[parallelism] tensor_parallel_degree = 2.0 has type float; expected int",
    ),
    (
        Case(T, 1, "toml", [["boost", "rank", True]]),
        "clean",
        "[boost] rank = True has type bool; expected int",
    ),
    (
        Case(T, 1, "toml", [["boost", "tp_plan", ["btp"]]]),
        "clean",
        "[boost] tp_plan = ['btp'] has type list",
    ),
    (
        Case(T, 1, "toml", [["model", "flavor", 1]]),
        "clean",
        "[model] flavor = 1 has type int; expected str",
    ),
    # --- [boost] against the model's shapes: failed at trainer construction
    (
        Case(T, 1, "cli", [["boost", "rank", "257"]]),
        "clean",
        "[boost] rank = 257 is too large for model 'cola_llama2' flavor 'debugmodel' "
        "(dim 256, ffn_dim 688); valid: 1 .. 256",
    ),
    (
        Case(T, 1, "cli", [["boost", "rank_ratio", "1e-9"]]),
        "clean",
        "[boost] rank_ratio = 1e-09 gives rank 0 for dim 256; valid ranks: 1 .. 256",
    ),
    (
        Case(T, 1, "cli", [["boost", "kv_rank", "257"]]),
        "clean",
        "[boost] kv_rank = 257 exceeds the k/v width 256",
    ),
    (
        Case("debug_lax.toml", 1, "cli", [["boost", "kv_rank", "31"]]),
        "clean",
        "[boost] kv_rank = 31 with model 'lax_llama2' flavor 'debugmodel' "
        "are not valid: Kronecker LaX gate",
    ),
    (
        Case("debug_llama2.toml", 1, "cli", [["boost", "rank", "32"]]),
        "clean",
        "[boost] rank = 32 applies to low-rank models only; "
        "model 'llama2' flavor 'debugmodel' is dense",
    ),
    (
        Case("debug_llama2.toml", 1, "cli", [["boost", "tp_plan", "btp"]]),
        "clean",
        "[boost] tp_plan = 'btp' does not apply to a dense model; valid plans for it: ['fullrank']",
    ),
    (
        Case(
            "debug_llama2.toml",
            1,
            "cli",
            [["boost", "latent_checkpoint", "mlp"], ["activation_checkpoint", "mode", "none"]],
        ),
        "clean",
        "[boost] latent_checkpoint = 'mlp' cannot be used: model 'llama2' is dense",
    ),
    (
        Case(C, 2, "cli", [["boost", "latent_checkpoint", "both"], ["boost", "rmsnorm", "sync"]]),
        "clean",
        "rmsnorm = 'sync' all-reduces inside the norm; use 'online'",
    ),
    # sequence-parallel latents: a btp option for SVD/CoLA under TP, online norm
    (
        Case("debug_lax_btp_tp2.toml", 2, "toml", [["boost", "sequence_parallel", True]]),
        "clean",
        "[boost] sequence_parallel = True cannot be used: LaX carries whole latents",
    ),
    (
        Case(T, 1, "toml", [["boost", "sequence_parallel", True]]),
        "clean",
        "[boost] sequence_parallel = True cannot be used: tensor_parallel_degree is 1",
    ),
    (
        Case(C, 2, "toml", [["boost", "sequence_parallel", True], ["boost", "tp_plan", "vanilla"]]),
        "clean",
        "cannot be used: tp_plan 'vanilla': sequence-parallel latents are a btp option",
    ),
    (
        Case(C, 2, "toml", [["boost", "sequence_parallel", True], ["boost", "rmsnorm", "sync"]]),
        "clean",
        "rmsnorm = 'sync' normalises before the reduction; use 'online'",
    ),
    (
        Case(C, 2, "toml", [["boost", "sequence_parallel_keep_gathered", True]]),
        "clean",
        "[boost] sequence_parallel_keep_gathered = True needs sequence_parallel = true",
    ),
    (
        Case(T, 1, "cli", [["boost", "cpu_peak_flops", "-5"]]),
        "clean",
        "[boost] cpu_peak_flops = -5.0 must be",
    ),
    (
        Case(T, 1, "cli", [["boost", "group_linears", "false"]]),
        "clean",
        "[boost] group_linears is a flag and takes no value (got 'false'): "
        "write --boost.group_linears to set it or --boost.no-group-linears",
    ),
    # --- folders the run writes: a 94-line traceback at start-up before (issue 48)
    (
        Case(T, 1, "cli", [["job", "dump_folder", "README.md/outputs"]]),
        "clean",
        "[job] dump_folder = 'README.md/outputs' cannot be made: ",
    ),
    (
        Case(T, 1, "cli", [["job", "dump_folder", "/proc/boost_outputs"]]),
        "clean",
        "[job] dump_folder = '/proc/boost_outputs' is not writable ('/proc': ",
    ),
    (
        Case(T, 1, "cli", [["metrics", "save_tb_folder", "/proc/tb"]]),
        "clean",
        "[metrics] save_tb_folder = '/proc/tb' is not writable",
    ),
    # --- [model], [job] config_file, files
    (
        Case(T, 1, "missing_config", [["job", "config_file", "no_such.toml"]]),
        "clean",
        "[job] config_file = ",
    ),
    (Case(T, 1, "bad_toml", [["job", "config_file", "<broken>"]]), "clean", "is not valid TOML"),
    (
        Case(T, 1, "tokenizer_without_json", [["model", "hf_assets_path", "<no tokenizer.json>"]]),
        "clean",
        "holds no tokenizer.json (found ['tokenizer_config.json'])",
    ),
    (
        Case(T, 1, "missing_tokenizer", [["model", "hf_assets_path", "/nonexistent/tok"]]),
        "clean",
        "[model] hf_assets_path = '/nonexistent/tok' does not exist",
    ),
    # --- [optimizer], [lr_scheduler], [metrics]: failed in torch's optimizer or mid-run
    (
        Case(T, 1, "cli", [["optimizer", "name", "SGD"]]),
        "clean",
        "[optimizer] name = 'SGD' is not valid; choose one of ['Adam', 'AdamW', 'LORO']",
    ),
    (
        Case(T, 1, "cli", [["optimizer", "name", "LORO"]]),
        "clean",
        "[optimizer] name = 'LORO' needs W = B A (a bottleneck without activation), but "
        "model 'cola_llama2' flavor 'debugmodel' has 'silu' inside",
    ),
    (
        Case(
            T,
            1,
            "cli",
            [
                ["model", "name", "svd_llama2"],
                ["optimizer", "name", "LORO"],
                ["boost", "latent_act", "silu"],
            ],
        ),
        "clean",
        "[optimizer] name = 'LORO' needs W = B A",
    ),
    (
        Case(T, 1, "cli", [["model", "name", "llama2"], ["optimizer", "name", "LORO"]]),
        "clean",
        "has no factors; use svd_llama2",
    ),
    (
        Case(T, 1, "cli", [["optimizer", "name", "LORO"], ["optimizer", "loro_freq", "0"]]),
        "clean",
        "[optimizer] loro_freq = 0 must be >= 1",
    ),
    (
        Case(T, 1, "cli", [["optimizer", "name", "LORO"], ["optimizer", "loro_refresh", "some"]]),
        "clean",
        "[optimizer] loro_refresh = 'some' is not valid; "
        "choose one of ['all', 'factors', 'regular', 'none']",
    ),
    (
        Case(T, 1, "cli", [["optimizer", "beta1", "1.5"]]),
        "clean",
        "[optimizer] beta1 = 1.5 must be in [0, 1)",
    ),
    (
        Case(T, 1, "cli", [["optimizer", "lr", "-0.001"]]),
        "clean",
        "[optimizer] lr = -0.001 must be a finite",
    ),
    (
        Case(T, 1, "cli", [["lr_scheduler", "total_steps", "5"]]),
        "clean",
        "[lr_scheduler] total_steps = 5 is below [training] steps = 20",
    ),
    (
        Case(T, 1, "cli", [["lr_scheduler", "warmup_steps", "-1"]]),
        "clean",
        "[lr_scheduler] warmup_steps = -1 must be >= 0",
    ),
    (
        Case(T, 1, "cli", [["metrics", "log_freq", "0"]]),
        "clean",
        "[metrics] log_freq = 0 must be >= 1",
    ),
    # --- [fault_tolerance] (torchft replica groups): refused before any rank starts
    (
        Case(T, 1, "ft_no_torchft", [*FT]),
        "clean",
        "[fault_tolerance] enable = true needs torchft, which is not installed: "
        ".venv/bin/pip install -e '.[ft]' (torchft==0.2.0)",
    ),
    (
        # a closed port: refused at once, within the check's 5 s bound, never a hang
        Case(T, 1, "ft_closed_lighthouse", [["env", "TORCHFT_LIGHTHOUSE", "<closed>"], *FT]),
        "clean",
        "': no lighthouse answers there within 5 s (Connection refused); start it first",
    ),
    (
        Case(T, 1, "ft", [["fault_tolerance", "replica_id", 2], *FT]),
        "clean",
        "[fault_tolerance] replica_id = 2 must be in 0..1 (group_size 2)",
    ),
    (
        Case(T, 1, "ft", [["fault_tolerance", "group_size", 0], FT[0]]),
        "clean",
        "[fault_tolerance] group_size = 0 must be >= 1 (the number of replica groups)",
    ),
    (
        Case(T, 1, "ft", [["fault_tolerance", "min_replica_size", 3], *FT]),
        "clean",
        "[fault_tolerance] min_replica_size = 3 must be in 1..2 (group_size 2)",
    ),
    (
        Case(
            "debug_svd_hsdp.toml",
            4,
            "ft",
            [["parallelism", "data_parallel_replicate_degree", 2], *FT],
        ),
        "clean",
        "[parallelism] data_parallel_replicate_degree = 2 with [fault_tolerance]: the replica "
        "groups are the replicate dimension; set it to 1",
    ),
    (
        Case("debug_lax_pp2.toml", 2, "ft", [["parallelism", "pipeline_parallel_degree", 2], *FT]),
        "clean",
        "[parallelism] pipeline_parallel_degree = 2 with [fault_tolerance]: a pipeline's "
        "stages would each need their own recovery",
    ),
    (
        Case(T, 2, "ft", [["parallelism", "context_parallel_degree", 2], *FT]),
        "clean",
        "[parallelism] context_parallel_degree = 2 with [fault_tolerance] is not supported",
    ),
    (
        Case(T, 1, "ft", [["fault_tolerance", "semi_sync_method", "bogus"], *FT]),
        "clean",
        "[fault_tolerance] semi_sync_method = 'bogus' is not a method: 'diloco', 'local_sgd' "
        "or none",
    ),
    (
        # torchtitan's own dataset: refused by its name (its files are not looked for)
        Case(T, 1, "ft", [["training", "dataset", "c4_test"], *FT]),
        "clean",
        "[training] dataset = 'c4_test' with [fault_tolerance]: replica groups need "
        "boost_titan's global data order",
    ),
    (
        Case(T, 1, "ft", [["training", "dataset", "c4"], *FT]),
        "clean",
        "[training] dataset = 'c4' with [fault_tolerance]: replica groups need",
    ),
    # --- odd but valid: accepted, and the trainer's early stages build
    # (the second of two replica groups: the checks above refuse values, not FT)
    (Case(T, 1, "ft", [["fault_tolerance", "replica_id", 1], *FT]), "accepted", ""),
    (Case(C, 4, "cli", [["parallelism", "data_parallel_shard_degree", "-1"]]), "accepted", ""),
    (
        Case(T, 1, "cli", [["boost", "rank_ratio", "0.1"], ["training", "steps", "1"]]),
        "accepted",
        "",
    ),
    (
        Case(
            "debug_lax_pp2.toml", 2, "cli", [["parallelism", "pipeline_parallel_schedule", "gpipe"]]
        ),
        "accepted",
        "",
    ),
]

_RUN = """
import json, sys
sys.path.insert(0, sys.argv[1])
from tests.config_fuzz import Case, generate, run_cases
fixed = [Case(**c) for c in json.loads(sys.argv[2])]
cases = fixed + generate(int(sys.argv[3]), int(sys.argv[4]))
out = run_cases(cases)
print("RESULT " + json.dumps([[o.category, o.detail, o.case.describe()] for o in out]))
"""


@pytest.fixture(scope="module")
def outcomes(corpus_dir):
    from dataclasses import asdict

    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _RUN,
            str(REPO),
            json.dumps([asdict(c) for c, _, _ in FIXED]),
            str(SEED),
            str(N_FUZZ),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.parametrize(
    "i", range(len(FIXED)), ids=[c.describe().split(" ", 1)[1][:80] for c, _, _ in FIXED]
)
def test_fixed_case(outcomes, i):
    case, category, message = FIXED[i]
    got_category, detail, described = outcomes[i]
    assert got_category == category, f"{described}: {got_category}: {detail}"
    assert message in detail, f"{described}: {detail}"


def test_seeded_fuzz_has_no_bugs(outcomes):
    fuzz = outcomes[len(FIXED) :]
    assert len(fuzz) == N_FUZZ
    bugs = [f"{d}\n  -> {detail}" for cat, detail, d in fuzz if cat == "bug"]
    assert not bugs, "\n".join(bugs)
    cats = {cat for cat, _, _ in fuzz}
    assert cats == {"clean", "accepted"}, cats  # the batch exercises both outcomes


def test_accepted_unusual_config_runs(corpus_dir, tmp_path):
    """TP2 with data_parallel_shard_degree -1 (filled in from WORLD_SIZE), a custom k/v
    rank, gradient accumulation (global batch 2 x local) and a short sequence: accepted
    at parse time, and it trains."""
    run = run_training(
        "debug_cola_btp_tp2.toml",
        2,
        tmp_path / "dump",
        "--parallelism.data_parallel_shard_degree",
        "-1",
        "--boost.kv_rank",
        "32",
        "--training.local_batch_size",
        "2",
        "--training.global_batch_size",
        "4",
        "--training.seq_len",
        "64",
        "--training.steps",
        "1",
        "--validation.no-enable",
        "--metrics.no-enable-tensorboard",
        "--lr_scheduler.warmup_steps",
        "0",
    )
    assert run.losses(0) and all(x == x for x in run.losses(0)), run.output[-3000:]
