"""torch.compile gives the eager numbers on every plan, or is refused when parsed.

The matrix runs on real gloo TP2 ranks in one launch (``compile_check.py``): for each
model under each plan it supports, with and without latent checkpointing, the
compiled copy (every block and the loss-parallel loss compiled, as the trainer does)
trains three AdamW steps (LORO rows: with an exact step) from the same weights as the
eager copy; losses and clipped grad norms must agree. TP2 x FSDP2 and PP2 x TP2 compiled runs are in
``test_composition.py`` (against the eager single process).
"""

from __future__ import annotations

import os

import pytest
from compile_check import FIELDS, as_row, run_cases

# measured (fp32, inductor on CPU): losses agree to <= 3e-7 relative, grad norms to
# <= 2e-7; inductor fuses and reorders reductions, so bitwise equality is not expected
LOSS_RTOL = 1e-5
GRAD_NORM_RTOL = 1e-5
# bf16 (autocast): compiled and eager round different intermediates to bf16 (inductor
# keeps fused values in fp32); measured <= 1e-4 relative (12-block CoLA, BTP TP2)
TOLERANCES = {"float32": (LOSS_RTOL, GRAD_NORM_RTOL), "bfloat16": (5e-4, 5e-4)}

# plan, arch, flavor, latent_checkpoint, keep, [activation_checkpoint] mode, optimizer,
# backend[, blocks (2), dtype (float32)]. Inductor where its code generation or its caches
# are what is tested: the deep bf16 CoLA row (inductor once dropped the statistic's low
# half), which the test also relaunches over the warm cache (the rank-local cache key: a
# cache shared by the ranks gave rank 0's loss-parallel graph to rank 1). aot_eager on
# the rest, torchtitan's full-rank plan included: the bugs those rows guard live in
# Dynamo, AOTAutograd and the partitioner (DTensor tracing, async collectives entering a
# block, recomputation under latent checkpointing, LORO's in-place rewrites between
# compiled calls), which aot_eager runs unchanged, without inductor's C++ builds on a
# cold cache (each rank builds its own: a 2-block LaX row under inductor took 57 s of
# the file's 183 s alone, twice that beside another test file). (The LORO rows reuse
# the AdamW rows' graphs.)
DEEP = 12  # blocks: more than torch._dynamo.config.recompile_limit (8)
BF16 = "bfloat16"
MATRIX = [
    ("fullrank", "dense", "debugmodel", "none", "attention", "none", "AdamW", "aot_eager"),
    ("btp", "svd", "debugmodel", "none", "attention", "none", "AdamW", "aot_eager"),
    # recipe-like: deeper than Dynamo's recompile limit and bf16 (autocast on TP-only: the
    # latents are bf16, so Online-RMSNorm's statistic rides as hi/lo columns), inductor
    ("btp", "cola", "debugmodel_gqa", "both", "attention", "none", "AdamW", "inductor", DEEP, BF16),
    ("btp", "lax", "debugmodel", "mlp", "none", "none", "AdamW", "aot_eager", DEEP),
    ("btp", "lax", "debugmodel_gqa", "attention", "attention", "none", "AdamW", "aot_eager"),
    ("vanilla", "svd", "debugmodel", "none", "attention", "none", "AdamW", "aot_eager"),
    ("vanilla", "cola", "debugmodel", "none", "attention", "none", "AdamW", "aot_eager", DEEP),
    ("vanilla", "lax", "debugmodel_gqa", "none", "attention", "none", "AdamW", "aot_eager"),
    ("btp", "svd", "debugmodel", "none", "attention", "none", "LORO", "aot_eager"),
    # sequence-parallel latents: deep, bf16 (the statistic's hi/lo columns reduce-
    # scattered), with latent checkpointing (its chunks then all-gather); and with LORO
    (
        "btp_sp",
        "cola",
        "debugmodel_gqa",
        "both",
        "attention",
        "none",
        "AdamW",
        "aot_eager",
        DEEP,
        BF16,
    ),
    ("btp_sp", "svd", "debugmodel", "none", "attention", "none", "LORO", "aot_eager"),
    ("vanilla", "svd", "debugmodel", "none", "attention", "none", "LORO", "aot_eager"),
]
WARM = [MATRIX[2]]  # the inductor row, relaunched over the same cache


def _assert_same(row: dict) -> None:
    eager, compiled = row["eager"], row["compiled"]
    _assert_profiles(row)
    loss_rtol, norm_rtol = TOLERANCES[row["dtype"]]
    for step, (a, b) in enumerate(zip(eager["loss"], compiled["loss"]), start=1):
        assert abs(a - b) <= loss_rtol * abs(a), (row, step)
    for step, (a, b) in enumerate(zip(eager["grad_norm"], compiled["grad_norm"]), start=1):
        assert abs(a - b) <= norm_rtol * abs(a), (row, step)
    # one compiled graph shared by every block (LaX: block 0, without a latent
    # crossing, has its own); a graph per block would hit the recompile limit at 9
    assert compiled["profile"]["block_graphs"] == (2 if row["arch"] == "lax" else 1), row
    if row["dtype"] == BF16:
        _assert_bf16_statistic(row["statistic"])


def _assert_bf16_statistic(check: dict) -> None:
    """Inductor's statistic is eager's, bitwise, and both keep ~16 mantissa bits of the
    fp32 sum (one bf16 column keeps 8: 937.50739 -> 936.0, 1.6e-3)."""
    print("bf16 statistic:", check)
    assert check["latent_bitwise"] and check["statistic_bitwise"], check
    assert check["rel_err_eager"] <= 2**-16 and check["rel_err_compiled"] <= 2**-16, check


def _assert_profiles(row: dict) -> None:
    """The step profiler (boost_titan.observability.step_profile) reads the same TP
    collectives, volume
    and executed FLOPs from a compiled step's profile as from an eager one's, and both
    equal CommCounter's count of the eager forward/backward (all-reduce-equivalent)."""
    eager, compiled = row["eager"]["profile"], row["compiled"]["profile"]
    assert eager["tp/collectives"] == eager["counted_collectives"] > 0, (row, eager)
    assert eager["tp/bytes_MiB"] == pytest.approx(eager["counted_volume_MiB"], rel=1e-9)
    if row["plan"] == "btp_sp":
        # AOTAutograd merges (CSE) LatentUp's backward all-gather of B's input with the
        # forward's, identical op on identical input: compiled, each of a block's 4
        # latent groups is gathered once less in backward (keep_gathered's trade)
        assert compiled["tp/collectives"] == eager["counted_collectives"] - 4 * row["layers"]
        assert compiled["tp/bytes_MiB"] < eager["counted_volume_MiB"]
    else:
        assert compiled["tp/collectives"] == eager["counted_collectives"], (row, compiled)
        assert compiled["tp/bytes_MiB"] == pytest.approx(eager["counted_volume_MiB"], rel=1e-9)
    if row["latent_checkpoint"] == "none" and row["ac"] == "none":
        assert eager["flops"] > 0
        assert compiled["flops"] == pytest.approx(eager["flops"], rel=1e-9)
    else:
        # Recomputation differs: eager checkpointing re-runs a whole chunk, while the
        # compiled graph's partitioner drops recomputed ops whose outputs backward does
        # not need (checkpoint(silu(x @ w1) @ w2): eager 8 matmuls fwd+bwd, compiled 7)
        assert 0 < compiled["flops"] <= eager["flops"]
    for prof in (eager, compiled):  # phases add up; collectives fit in their phase
        assert prof["time/forward_ms"] + prof["time/backward_ms"] <= prof["time/step_ms"]
        assert 0 < prof["tp/comm_forward_ms"] < prof["time/forward_ms"]
        assert 0 < prof["tp/comm_backward_ms"] < prof["time/backward_ms"]


# Inductor's C++ builds dominate (~1 min per configuration on 2 cores, cold): keep the
# cache between runs of the suite. Safe: keys hash the graphs, torch and inductor
# config, and every rank has its own folder (boost_titan.parallel.compile).
CACHE = os.environ.get(
    "BOOST_TEST_INDUCTOR_CACHE",
    os.path.join(os.path.expanduser("~"), ".cache", "boost_titan", "test_inductor"),
)


@pytest.mark.slow
def test_compiled_equals_eager_on_tp2_ranks(tmp_path):
    cache = CACHE
    rows = run_cases(MATRIX, str(tmp_path / "cold"), cache)
    assert len(rows) == len(MATRIX)
    for row in rows:
        print(
            {k: row[k] for k in FIELDS},
            "eager",
            row["eager"]["loss"],
            "compiled",
            row["compiled"]["loss"],
            f"{row['eager']['seconds']:.1f}s / {row['compiled']['seconds']:.1f}s (incl. compile)",
        )
        _assert_same(row)
    # Warm cache: a second launch over the same inductor cache loads these graphs from
    # disk (the first launch may have too, from an earlier run). Before rank-local caches,
    # each rank loaded whichever rank's loss-parallel graph was written last (its vocabulary
    # offset baked in): 16.75 vs 9.42.
    assert all(as_row(case)["backend"] == "inductor" for case in WARM)
    warm = run_cases(WARM, str(tmp_path / "warm"), cache)
    for row in warm:
        _assert_same(row)


# Parsing imports torchtitan, which must come after boost_titan's CPU runtime: run in a
# fresh interpreter (other tests of this process may have imported torchtitan).
_REFUSALS = """
import pytest
from boost_titan.parallel import cpu_runtime
cpu_runtime.activate()
from boost_titan.train.config_check import parse_config

tp2, compiled, no_ac = (["--parallelism.tensor_parallel_degree", "2"], ["--compile.enable"],
                        ["--activation_checkpoint.mode", "none"])
keep_none = ["--boost.latent_checkpoint", "both", "--boost.latent_checkpoint_keep", "none"]
with pytest.raises(ValueError, match="latent_checkpoint_keep = 'attention'.*mlp.*enable = false"):
    parse_config(tp2 + compiled + no_ac + keep_none)
# each change the message proposes parses
parse_config(tp2 + compiled + no_ac + keep_none[:3] + ["attention"])
parse_config(tp2 + compiled + no_ac + ["--boost.latent_checkpoint", "mlp"] + keep_none[2:])
parse_config(tp2 + no_ac + keep_none)
parse_config(tp2 + compiled + no_ac + keep_none + ["--compile.components", "loss"])
for mode in ("full", "selective"):
    ac = ["--activation_checkpoint.mode", mode]
    with pytest.raises(ValueError, match=f"mode = '{mode}' fails when compiled.*latent_checkpoint"):
        parse_config(tp2 + compiled + ac)
    parse_config(tp2 + ac)  # eager
    parse_config(compiled + ac)  # one process
print("REFUSALS OK")
"""


def test_uncompilable_combinations_are_refused_when_parsed():
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _REFUSALS], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "REFUSALS OK" in proc.stdout, proc.stderr[-3000:]
