"""The per-step profiling scalars (boost_titan.observability.step_profile): closed forms
on hand-built
profiler events, executed FLOPs against the model's FLOP formula, and real runs against
CommCounter's count of the same collectives (``--boost.log_comm``)."""

from __future__ import annotations

import json

import pytest
from helpers import run_training

from boost_titan.observability.profile_events import (
    BACKWARD,
    STEP,
    WINDOW,
    Event,
    collect,
    executed_flops,
    from_kineto,
    summary,
)
from boost_titan.observability.step_profile import scalars

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
        _host("cudaLaunchKernel", 220, 230, correlation=76, runtime=True),
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
        _host("c10d::_allgather_base_", 850, 900, correlation=88),
        _host("cudaLaunchKernel", 860, 870, correlation=88, runtime=True),
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
        Event("ncclDevKernel_AllReduce_Sum_f32", 1200, 1300, device=True, correlation=76),
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


class _KinetoEvent:
    """What :func:`from_kineto` reads of torch's ``_KinetoEvent`` (times given in us).
    CPU ops and record_function ranges carry their own correlation id (the ops' counter)
    and linked id 0; the CUDA runtime's host calls (``cudaLaunchKernel``) and the kernels
    carry CUPTI's correlation id (another counter, the same for a launch and its kernel)
    and, linked, the id of the CPU op they were launched from."""

    def __init__(self, name, start, end, corr, linked=0, *, activity="cpu_op", **kw):
        self._name, self._start, self._end = name, start, end
        self._corr, self._linked, self._activity = corr, linked, activity
        self._thread = kw.get("thread", 1)
        self._shapes, self._dtypes = kw.get("shapes", []), kw.get("dtypes", [])
        self._concrete = kw.get("concrete", [])

    def name(self):
        return self._name

    def device_type(self):
        from torch.autograd import DeviceType

        device = self._activity in ("kernel", "gpu_memcpy", "gpu_user_annotation")
        return DeviceType.CUDA if device else DeviceType.CPU

    def activity_type(self):
        return self._activity

    def start_ns(self):
        return int(self._start * 1000)

    def end_ns(self):
        return int(self._end * 1000)

    def start_thread_id(self):
        return self._thread

    def correlation_id(self):
        return self._corr

    def linked_correlation_id(self):
        return self._linked

    def is_async(self):
        return False

    def is_user_annotation(self):
        return self._activity in ("user_annotation", "gpu_user_annotation")

    def shapes(self):
        return self._shapes

    def dtypes(self):
        return self._dtypes

    def concrete_inputs(self):
        return self._concrete

    def flops(self):
        return 0

    def sequence_nr(self):
        return -1


def _launch(name, start, end, cupti, op, kernel_start, kernel_end, thread=1):
    """A host runtime call inside CPU op ``op`` and the kernel it launched."""
    return [
        _KinetoEvent(
            "cudaLaunchKernel", start, end, cupti, op, activity="cuda_runtime", thread=thread
        ),
        _KinetoEvent(name, kernel_start, kernel_end, cupti, op, activity="kernel"),
    ]


_ALL_REDUCE_4x8 = dict(
    shapes=[[4, 8], [], []], dtypes=["float", "", ""], concrete=[None, "sum", "0"]
)


def _gpu_trace() -> list[_KinetoEvent]:
    """One GPU step (us): the host queues the forward's kernels far ahead of the device
    (its first backward op starts at 400, the device finishes the forward at 3000); op ids
    and CUPTI ids collide (CUPTI id 5 is the grad-norm launch, op 5 the forward's c10d
    all-reduce). Thread 2 is autograd's device thread."""
    K = _KinetoEvent
    ar = "ncclDevKernel_AllReduce_Sum_f32_RING_LL"
    return [
        K(STEP, 0, 10000, 1, activity="user_annotation"),
        K(WINDOW, 100, 5000, 2, activity="user_annotation"),
        K(STEP, 0, 10000, 100, 1, activity="gpu_user_annotation"),  # not compute
        K("aten::mm", 200, 220, 3),
        *_launch("sm90_xmma_gemm", 205, 215, 10, 3, 300, 2000),
        K("_c10d_functional::all_reduce", 230, 260, 4, **_ALL_REDUCE_4x8),
        K("c10d::allreduce_", 235, 255, 5),
        *_launch(ar, 240, 250, 11, 5, 2000, 2400),
        K("_c10d_functional::wait_tensor", 270, 280, 6),
        K("aten::mm", 300, 320, 7),
        *_launch("sm90_xmma_gemm", 305, 315, 12, 7, 2400, 3000),
        # a pipeline-style send: its kernel waits on the peer on NCCL's stream, beside
        # the compute; it must not move the phase boundary
        K("c10d::send", 330, 340, 15),
        *_launch("ncclDevKernel_SendRecv", 332, 338, 17, 15, 350, 4800),
        # backward, on autograd's device thread
        K(f"{BACKWARD}: MmBackward0", 400, 600, 8, thread=2),
        K("aten::mm", 420, 440, 9, thread=2),
        *_launch("sm90_xmma_gemm", 425, 435, 13, 9, 3000, 4100, thread=2),
        K("_c10d_functional::all_reduce", 450, 480, 10, thread=2, **_ALL_REDUCE_4x8),
        K("c10d::allreduce_", 455, 475, 11, thread=2),
        *_launch(ar, 460, 470, 14, 11, 4000, 4500, thread=2),
        K("cudaDeviceSynchronize", 4900, 4990, 16, 2, activity="cuda_runtime"),
        # after the forward/backward: the grad-norm all-reduce (not TP)
        K(
            "_c10d_functional::all_reduce",
            5100,
            5150,
            12,
            shapes=[[1], [], []],
            dtypes=["float", "", ""],
            concrete=[None, "sum", "0"],
        ),
        K("c10d::allreduce_", 5110, 5140, 13),
        *_launch(ar, 5120, 5130, 5, 13, 5200, 5300),
    ]


def _profiled(kineto_events):
    from types import SimpleNamespace

    results = SimpleNamespace(events=lambda: kineto_events)
    return SimpleNamespace(profiler=SimpleNamespace(kineto_results=results))


def test_gpu_trace_device_side_phases_and_nccl_attribution():
    """GPU: a NCCL kernel belongs to the CPU op it was launched from (runtime calls'
    CUPTI ids collide with op ids and are never keyed on), and forward ends when the
    device has finished the kernels launched before the host's first backward op."""
    events = from_kineto(_profiled(_gpu_trace()))
    launch = next(e for e in events if e.name == "cudaLaunchKernel" and e.start == 5120)
    assert launch.runtime and launch.correlation == 13 and not launch.device
    ev = collect(events, device=True)
    # forward: the gemms launched before 400 end at 2000 and 3000 and the TP
    # all-reduce's kernel at 2400 on the device (the send's 4800 is not phase work)
    assert ev.backward_starts == [3000.0]
    s = scalars(ev, device=True)
    expected = {
        "time/step_ms": 10.0,
        "time/forward_ms": 2.9,  # 100 -> 3000, not the host's 100 -> 400
        "time/backward_ms": 2.0,  # 3000 -> 5000
        "time/optimizer_ms": 5.0,
        "tp/comm_forward_ms": 0.4,  # kernel 2000-2400, launched from op 5
        "tp/comm_backward_ms": 0.5,  # 4000-4500
        "tp/compute_forward_ms": 2.5,
        "tp/compute_backward_ms": 1.5,
        "tp/comm_share_pct": 9.0,
        "tp/bytes_MiB": 2 * 128 / MIB,
        "tp/collectives": 2.0,
        "comm/other_ms": 4.55,  # send 350-4800 (covers both TP kernels) + grad norm 0.1
        # comm 350-4800 and 5200-5300 less the gemms 350-2000, 2400-3000, 3000-4100
        "comm/exposed_ms": 4.55 - (1.65 + 0.6 + 1.1),
    }
    assert s == pytest.approx(expected, rel=1e-9)
    # interleaved (pipeline) schedules: the backward node 400-600 runs on the device
    # from 3000 until its gemm and its TP all-reduce are done, 4500
    s = scalars(ev, device=True, interleaved=True)
    assert s["time/backward_ms"] == pytest.approx(1.5)
    assert s["time/forward_ms"] == pytest.approx(4.9 - 1.5)


def test_gpu_trace_on_cpu_keeps_host_phases():
    """The same trace read as a CPU run (device=False): phases and collective time from
    host ops, as before."""
    s = scalars(collect(from_kineto(_profiled(_gpu_trace())), device=False), device=False)
    assert s["time/forward_ms"] == pytest.approx(0.3)
    assert s["time/backward_ms"] == pytest.approx(4.6)
    assert s["tp/comm_forward_ms"] == pytest.approx(0.03 + 0.01)  # all-reduce + wait
    assert s["tp/comm_backward_ms"] == pytest.approx(0.03)


def test_executed_flops_of_a_model_closed_form():
    """One device, fwd + bwd: the profiler's matmuls are exactly the model's 6 x MACs,
    and attention runs 3.5x its forward (backward recomputes the scores), where MFU's
    formula counts 3x: executed = model + attention / 6, per token."""
    import torch
    from torch.profiler import profile

    from boost_titan.parallel import cpu_runtime

    cpu_runtime.activate()
    from boost_titan.models.flavors import flavors_for
    from boost_titan.models.model import Transformer
    from boost_titan.observability.profile_events import from_kineto

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

    from boost_titan.observability.step_profile import StepProfiler

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
