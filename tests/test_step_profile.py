"""The per-step profiling scalars (boost_titan.step_profile): closed forms on hand-built
profiler events, executed FLOPs against the model's FLOP formula, and real runs against
CommCounter's count of the same collectives (``--boost.log_comm``)."""

from __future__ import annotations

import json

import pytest
from helpers import run_training

from boost_titan.step_profile import (
    BACKWARD,
    STEP,
    WINDOW,
    Event,
    collect,
    executed_flops,
    scalars,
    summary,
)

MIB = 2**20


def _host(name, start, end, **kw):
    return Event(name, start, end, thread=1, **kw)


def _events() -> list[Event]:
    """One step (us): forward/backward call 100-800, backward from 500."""
    return [
        _host(STEP, 0, 1000),
        _host(WINDOW, 100, 800),
        # collective points (LatentComm.scope); the op at 362 makes autograd node 7
        _host("btp/layer3/reduce_down_qkv", 195, 295),
        _host("btp/layer3/enter_up_qkv", 360, 370),
        _host("ToLocal", 362, 365, sequence_nr=7),
        # forward: an all-reduce of 4x8 fp32 (its c10d op inside is not counted again)
        _host(
            "_c10d_functional::all_reduce",
            200,
            260,
            shapes=[[4, 8], [], []],
            dtypes=["float", "", ""],
            concrete=[None, "sum", "0"],
        ),
        _host("c10d::allreduce_", 210, 250, correlation=76),
        _host("cudaLaunchKernel", 220, 230, correlation=77),
        _host("_c10d_functional::wait_tensor", 270, 290, shapes=[[4, 8]], dtypes=["float"]),
        _host("aten::mm", 300, 350, flops=1000),
        # an op on DTensors: recorded at the global shape, the local op inside it
        _host("aten::mm", 400, 480, flops=5000),
        _host("aten::mm", 410, 470, flops=2500),
        _host(
            "aten::_scaled_dot_product_flash_attention_for_cpu",
            480,
            490,
            shapes=[[1, 2, 4, 8], [1, 2, 4, 8], [1, 2, 4, 8], []],
        ),
        # backward: an all-gather of 2x8 bf16 over 4 ranks, inside autograd's ops
        _host(f"{BACKWARD}: ToLocalBackward", 500, 790, sequence_nr=7),
        _host(f"{BACKWARD}: inner", 700, 720),
        _host(
            "_c10d_functional::all_gather_into_tensor",
            600,
            640,
            shapes=[[2, 8], [], []],
            dtypes=["c10::BFloat16", "", ""],
            concrete=[None, 4, "0"],
        ),
        # after the backward: an FSDP-style c10d collective and the grad-norm all-reduce
        _host("c10d::_allgather_base_", 850, 900),
        _host("cudaLaunchKernel", 860, 870, correlation=88),
        _host(
            "_c10d_functional::all_reduce",
            910,
            930,
            shapes=[[1], [], []],
            dtypes=["float", "", ""],
            concrete=[None, "sum", "0"],
        ),
    ]


EXPECTED_FLOPS = 1000 + 2500 + 2 * (2 * 4 * 4 * 8 * 2)  # mm, local mm, q@k^T and p@v


def test_scalars_from_host_events_closed_form():
    ev = collect(_events(), device=False)
    assert ev.tp_count == 2 and ev.tp_bytes == 4 * 8 * 4 + 2 * 8 * 2 * 4
    s = scalars(ev, device=False)
    expected = {
        "time/step_ms": 1.0,
        "time/forward_ms": 0.4,
        "time/backward_ms": 0.3,
        "time/optimizer_ms": 0.2,
        "tp/comm_forward_ms": 0.08,  # all-reduce 60 + wait 20
        "tp/comm_backward_ms": 0.04,
        "tp/compute_forward_ms": 0.32,
        "tp/compute_backward_ms": 0.26,
        "tp/comm_share_pct": 12.0,
        # all-reduce-equivalent: the all-reduce's 128 B, half the all-gather's 128 B
        "tp/bytes_MiB": (128 + 64) / MIB,
        "tp/collectives": 2.0,
        "comm/other_ms": 0.07,
        "comm/exposed_ms": 0.19,  # on CPU every collective blocks the step
    }
    assert s == pytest.approx(expected, rel=1e-9)
    # a pipeline schedule interleaves: backward is the time inside autograd's ops
    s = scalars(ev, device=False, interleaved=True)
    assert s["time/backward_ms"] == pytest.approx(0.29)
    assert s["time/forward_ms"] == pytest.approx(0.41)
    assert ev.flops == EXPECTED_FLOPS == executed_flops([e for e in _events() if not e.device])


def test_summary_names_collectives_by_point():
    """Forward collectives by their scope; a backward one by the scope of the forward op
    that made its autograd node (same sequence number); outside any: the stack ends."""
    text = summary(_events())
    assert "| btp/layer3/reduce_down_qkv | forward | all_reduce | 1 | 0.000 | 0.08 |" in text
    assert "| btp/layer3/enter_up_qkv | backward | all_gather | 1 | 0.000 | 0.04 |" in text
    assert text.count("| (outside the blocks)") == 0  # the grad-norm all-reduce: not TP
    top = text.split("self time:")[1]
    # self time: 50 us + the global-shape mm's 80 less the local mm's 60 inside it + 60
    assert "| aten::mm | 3 | 0.13 |" in top and "btp/layer3" not in top


def test_scalars_from_device_kernels_closed_form():
    """GPU: collective time is the NCCL kernels' (by the op that launched them), exposed
    is what no compute kernel covers; annotations and copies are not compute."""
    events = _events() + [
        Event("boost/step", 0, 5000, device=True, annotation=True),
        Event("ncclDevKernel_AllReduce_Sum_f32", 1200, 1300, device=True, correlation=77),
        Event("sm90_xmma_gemm", 1250, 1400, device=True, correlation=5),
        Event("Memcpy DtoD", 1290, 1300, device=True),
        Event("ncclDevKernel_AllGather", 1500, 1550, device=True, correlation=88),
    ]
    s = scalars(collect(events, device=True), device=True)
    assert s["tp/comm_forward_ms"] == pytest.approx(0.1)
    assert s["tp/comm_backward_ms"] == 0.0
    assert s["comm/other_ms"] == pytest.approx(0.05)
    assert s["comm/exposed_ms"] == pytest.approx(0.05 + 0.05)  # 50 us hidden under the GEMM
    assert s["tp/collectives"] == 2.0  # counted from the host ops, as on CPU


def test_executed_flops_of_a_model_closed_form():
    """One device, fwd + bwd: the profiler's matmuls are exactly the model's 6 x MACs,
    and attention runs 3.5x its forward (backward recomputes the scores), where MFU's
    formula counts 3x: executed = model + attention / 6, per token."""
    import torch
    from torch.profiler import profile

    from boost_titan import cpu_runtime

    cpu_runtime.activate()
    from boost_titan.models.flavors import flavors_for
    from boost_titan.models.model import Transformer
    from boost_titan.step_profile import from_kineto

    for arch in ("dense", "cola"):
        args = flavors_for(arch)["debugmodel"]
        torch.manual_seed(0)
        model = Transformer(args)
        with torch.no_grad():
            model.init_weights()
        b, s = 2, 128
        tokens = torch.randint(0, args.vocab_size, (b, s))
        with profile(record_shapes=True, with_flops=True) as prof:
            model(tokens).sum().backward()
        executed = executed_flops([e for e in from_kineto(prof) if not e.device]) / (b * s)
        attention = 12 * args.n_layers * args.n_heads * args.head_dim * s
        assert executed == pytest.approx(args.flops_per_token(s) + attention / 6, rel=1e-12), arch


@pytest.mark.slow
def test_tp2_run_profiles_what_commcounter_counts(corpus_dir, tmp_path):
    """The default debug layout (CoLA, BTP, TP2): the profiled step's TP collectives and
    all-reduce-equivalent volume equal CommCounter's count of step 1 (log_comm), HFU is
    MFU times the closed-form executed/model FLOPs (BTP repeats no matmul on its ranks),
    and the phases add up."""
    from boost_titan.models.flavors import flavors_for

    run = run_training(
        "debug_cola_btp_tp2.toml",
        2,
        tmp_path,
        "--training.steps",
        "3",
        "--validation.no-enable",
        "--boost.log_comm",
    )
    assert "profile step 2:" in run.output
    counted = json.loads((tmp_path / "comm_stats.json").read_text())
    (event_file,) = run.tb_event_files()
    values = _scalar_values(event_file)
    s = {tag: v[2] for tag, v in values.items() if 2 in v}
    totals = counted["totals"]
    assert s["tp/collectives"] == totals["forward_collectives"] + totals["backward_collectives"]
    volume = sum(
        row["bytes"] / (2 if op.split("/")[1].startswith(("all_gather", "reduce_scatter")) else 1)
        for op, row in counted["by_op"].items()
    )
    assert s["tp/bytes_MiB"] == pytest.approx(volume / MIB, rel=1e-6)
    assert (
        s["time/forward_ms"] + s["time/backward_ms"] + s["time/optimizer_ms"] <= s["time/step_ms"]
    )
    assert 0 < s["tp/comm_forward_ms"] < s["time/forward_ms"]
    assert 0 < s["tp/comm_backward_ms"] < s["time/backward_ms"]
    assert s["comm/exposed_ms"] >= s["tp/comm_forward_ms"] + s["tp/comm_backward_ms"] - 1e-9
    args = flavors_for("cola")["debugmodel"]
    seq = 256
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * seq
    ratio = (args.flops_per_token(seq) + attention / 6) / args.flops_per_token(seq)
    assert values["throughput/hfu_pct"][3] / values["mfu(%)"][3] == pytest.approx(ratio, rel=1e-3)
    assert sorted(values["throughput/hfu_pct"]) == [3]


@pytest.mark.slow
def test_pp2_run_splits_interleaved_phases(corpus_dir, tmp_path):
    """PP2 (1F1B over 2 microbatches): forward and backward both measured, no TP
    collectives, the stages' send/recv counted as other communication."""
    run = run_training(
        "debug_lax_pp2.toml", 2, tmp_path, "--training.steps", "2", "--validation.no-enable"
    )
    (event_file,) = run.tb_event_files()
    values = _scalar_values(event_file)
    s = {tag: v[2] for tag, v in values.items() if 2 in v}
    assert s["tp/collectives"] == 0 and s["tp/bytes_MiB"] == 0
    assert s["time/forward_ms"] > 0 and s["time/backward_ms"] > 0
    assert s["time/forward_ms"] + s["time/backward_ms"] <= s["time/step_ms"]
    assert s["comm/other_ms"] > 0


def _scalar_values(path: str) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(path, size_guidance={"scalars": 0})
    acc.Reload()
    return {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}


def test_sampling_skips_torchtitan_profiler_steps():
    """kineto runs one session at a time: with [profiling] on, the steps its schedule
    warms up or records on (step k runs at its counter k - 1) are not sampled."""
    from types import SimpleNamespace

    from boost_titan.step_profile import StepProfiler

    titan = SimpleNamespace(
        enable_profiling=True, profile_freq=3, profiler_warmup=1, profiler_active=1
    )
    sampled = [k for k in range(1, 13) if StepProfiler(2, "cpu", profiling_config=titan).wants(k)]
    assert sampled == [4, 10]  # 2, 6, 8, 12 fall on torchtitan's warm-up/record steps
    plain = [k for k in range(1, 13) if StepProfiler(2, "cpu").wants(k)]
    assert plain == [2, 4, 6, 8, 10, 12]
    assert not any(StepProfiler(0, "cpu").wants(k) for k in range(1, 13))


@pytest.mark.slow
def test_profiling_traces_for_tensorboard_plugin(corpus_dir, tmp_path):
    """--profiling.enable_profiling: traces named as torch-tb-profiler finds them, with
    every block's collective points labelled; the step profiler samples around them."""
    run = run_training(
        "debug_cola_btp_tp2.toml",
        2,
        tmp_path,
        "--training.steps",
        "4",
        "--validation.no-enable",
        "--profiling.enable_profiling",
        "--profiling.profile_freq",
        "3",
        "--profiling.profiler_warmup",
        "1",
        "--profiling.profiler_active",
        "1",
        "--boost.profile_freq",
        "2",
    )
    assert "profile step 4:" in run.output and "profile step 2:" not in run.output
    traces = sorted(p.name for p in (tmp_path / "profile_trace" / "iteration_3").iterdir())
    assert traces == ["rank0.pt.trace.json", "rank1.pt.trace.json"]
    trace = json.loads((tmp_path / "profile_trace" / "iteration_3" / traces[0]).read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    for layer in range(4):  # debugmodel: 4 blocks, each with its 4 reduce_down points
        for group in ("qkv", "o", "gate_up", "down"):
            assert f"btp/layer{layer}/reduce_down_{group}" in names
