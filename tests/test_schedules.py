"""Every pipeline schedule torchtitan 0.2.2 offers, with every feature and under
context parallelism, trains a low-rank model exactly as the single process does, or is
refused when its config is parsed (``boost_titan.parallel.pipeline.check_pipeline_config``,
``boost_titan.config.CP_PP_SCHEDULES``).

One launch of two gloo ranks runs the whole matrix (``schedule_check.py``): CoLA and
LaX under each schedule with grouped and ungrouped linears, latent checkpointing and
compiled blocks (``aot_eager``), and LORO on SVD (the architecture it needs). One more
launch of four (PP2 x CP2: ring attention, FSDP2 over dp x cp, each rank half of every
sequence) runs CoLA (grouped linears, eager) under each schedule. Each case trains three
steps with torchtitan's default (fused) AdamW from the same weights and batches as a
single-process run on the same rank; its loss and gradient norm must equal that run's.
"""

from __future__ import annotations

import pytest
from schedule_check import FEATURES, SCHEDULES, run_cases

from boost_titan.config import CP_PP_REFUSED, CP_PP_SCHEDULES

# fp32: the pipelined and single-process losses agree to ~2e-7 (step 1: the loss is
# summed per microbatch); a wrong update shows at 1e-4 and more (zero-bubble schedules
# with transposed gradients: 9.56866 vs 9.56788 at step 2)
LOSS_RTOL = 1e-5
# the gradient's float64 norm (fp32 norms differ by summation order): agrees to ~5e-9;
# Adam's first updates hide a wrongly scaled gradient, the norm does not
GRAD_NORM_RTOL = 1e-5
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
CASES = [
    (arch, schedule, feature)
    for arch in ("cola", "lax")
    for schedule in SCHEDULES
    for feature in FEATURES
    if feature != "loro"
] + [("svd", schedule, "loro") for schedule in SCHEDULES]
# what is refused (when parsed; DualPipeV when training starts on a CPU) and the phrase
# the refusal must contain
REFUSED = {
    **{
        (s, f): "selective activation checkpointing can be backpropagated only once"
        for s in SPLIT_BACKWARD
        for f in ("latent_checkpoint",)
    },
    **{(s, "compiled"): "refuses compiled stage modules" for s in SPLIT_BACKWARD},
    # on CPU: torch runs DualPipeV's overlapped forward+backward on accelerator streams
    **{
        ("DualPipeV", f): "needs a GPU"
        for f in FEATURES
        if f not in ("latent_checkpoint", "compiled")
    },
}


# PP2 x CP2 (4 ranks, one more launch, ~25 s): CoLA with grouped linears, eager, under
# every schedule; each rank holds half of every sequence (ring attention, FSDP2 over
# dp x cp); the loss is the batch's: the CP ranks' shares summed
CP = 2
CP_CASES = [("cola", schedule, "grouped") for schedule in SCHEDULES]
# refused under CP when parsed (DualPipeV: it runs only on GPUs, untested here)
CP_REFUSED = {(s, "grouped"): CP_PP_REFUSED[s] for s in SCHEDULES if s not in CP_PP_SCHEDULES}


def _check(rows: list[dict], cases: list, refused: dict) -> None:
    assert [(r["arch"], r["schedule"], r["feature"]) for r in rows] == cases
    for row in rows:
        outcome = row.get("refused") or row.get("error") or row["loss"]
        print(f"cp{row['cp']} {row['arch']:5} {row['schedule']:22} {row['feature']:18} {outcome}")
    for row in rows:
        phrase = refused.get((row["schedule"], row["feature"]))
        if phrase is not None:
            assert phrase in row.get("refused", ""), row
            continue
        assert "refused" not in row and "error" not in row, row
        for step, (ref, got) in enumerate(zip(row["reference"], row["loss"]), start=1):
            assert abs(got - ref) <= LOSS_RTOL * abs(ref), (row, step)
        pairs = zip(row["reference_grad_norm"], row["grad_norm"])
        for step, (ref, got) in enumerate(pairs, start=1):
            assert abs(got - ref) <= GRAD_NORM_RTOL * ref, (row, step)


@pytest.mark.slow
def test_every_schedule_equals_the_single_process_or_is_refused(tmp_path):
    _check(run_cases(CASES, str(tmp_path)), CASES, REFUSED)


@pytest.mark.slow
def test_every_schedule_under_context_parallelism_equals_the_single_process_or_is_refused(
    tmp_path,
):
    _check(run_cases(CP_CASES, str(tmp_path), cp=CP), CP_CASES, CP_REFUSED)
