"""The side-by-side benchmark runs end to end in smoke mode and writes its outputs;
its flags do what they say; the GPU check's smoke mode covers every section."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_bench_smoke_writes_all_outputs(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "boost_titan.cli", "bench", "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("results.json", "results.md", "step_time.png", "comm_share.png"):
        assert (out / name).stat().st_size > 0, name
    summary = json.loads((out / "results.json").read_text())
    v = summary["variants"]
    assert set(v) >= {"btp", "vanilla", "fullrank", "btp-ungrouped", "btp-sync-norm"}
    for name, r in v.items():
        assert r["steps_timed"] == 2 and r["step_time_median_s"] > 0 and r["tokens_per_s"] > 0, name
        assert 0 < r["comm_share"] < 1, name
    # counted bytes: the smoke shape's per-step volumes, independent of timing noise
    assert v["vanilla"]["volume_per_step"] > 3 * v["btp"]["volume_per_step"]
    assert v["btp-ungrouped"]["volume_per_step"] == v["btp"]["volume_per_step"]
    assert v["btp-ungrouped"]["collectives_per_step"] > v["btp"]["collectives_per_step"]
    assert "btp_vs_vanilla_tokens_per_s" in summary["ratios"]
    # sequence-parallel latents: each rank keeps 1/T of every latent; the forward
    # volume is BTP's, backward regathers each latent once more
    assert v["btp-sp"]["saved_activation_mib"] < v["btp"]["saved_activation_mib"]
    assert 1 < summary["ratios"]["sp_vs_btp_volume"] < 1.5
    md = (out / "results.md").read_text()
    assert "| btp |" in md and "comm/step MiB (all-reduce-equiv.)" in md
    assert "`fullrank`: full-rank dense twin, torchtitan Megatron+SP plan" in md  # the legend
    _check_volume_convention(summary)
    _check_tensorboard_runs(out / "tb", summary)


def _check_volume_convention(summary: dict) -> None:
    """Every volume is all-reduce-equivalent: an all-reduce counts its payload, an
    all-gather or reduce-scatter half of it (comm_stats.allreduce_equivalent, the
    planner's convention); bytes_per_step keeps the raw payload."""
    from boost_titan.observability.comm_stats import allreduce_equivalent

    v = summary["variants"]
    for name, r in v.items():
        by_op = r["comm_by_op"]
        assert sum(c["count"] for c in by_op.values()) == r["collectives_per_step"], name
        assert sum(c["bytes"] for c in by_op.values()) == r["bytes_per_step"], name
        expected = sum(
            allreduce_equivalent(
                op.removesuffix("_into_tensor").removesuffix("_tensor"), c["bytes"]
            )
            for op, c in by_op.items()
        )
        assert r["volume_per_step"] == pytest.approx(expected), name
    # full-rank TP (sequence parallel) moves activations by all-gather / reduce-scatter:
    # half its raw payload counts; vanilla and BTP's blocks all-reduce
    full = v["fullrank"]
    ag_rs = sum(c["bytes"] for op, c in full["comm_by_op"].items() if op != "all_reduce")
    assert ag_rs > 0
    assert full["volume_per_step"] == full["bytes_per_step"] - ag_rs / 2
    assert v["vanilla"]["volume_per_step"] == v["vanilla"]["bytes_per_step"]
    ratios = summary["ratios"]
    assert ratios["vanilla_vs_btp_volume"] == pytest.approx(
        v["vanilla"]["volume_per_step"] / v["btp"]["volume_per_step"]
    )
    assert ratios["fullrank_vs_btp_volume"] == pytest.approx(
        full["volume_per_step"] / v["btp"]["volume_per_step"]
    )


def _check_tensorboard_runs(tb, summary: dict) -> None:
    """One TensorBoard run per variant, the same tags in each, values = results.json's,
    and the training dashboard's custom-scalars layout in each."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    from boost_titan.observability.dashboard import BENCH_CHARTS, layout
    from boost_titan.perf.bench.report import TB_TAGS

    charts = {
        cat: {title: chart[1] for title, chart in titles.items()}
        for cat, titles in layout(validation=False, charts=BENCH_CHARTS).items()
    }
    # the dashboard's benchmark charts name exactly the tags every run writes
    assert {t for _, _, tags in BENCH_CHARTS for t in tags} == set(TB_TAGS)

    v = summary["variants"]
    runs = {p.name for p in tb.iterdir() if p.is_dir()}
    assert runs == set(v) | {"ratios"}  # tb/<id>/: the ids as they are
    tokens = summary["shape"]["batch"] * summary["shape"]["seq"]
    for name, r in v.items():
        acc = EventAccumulator(str(tb / name), size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        assert set(acc.Tags()["scalars"]) == set(TB_TAGS), name
        [config] = acc.Tensors("custom_scalars__config__")  # the dashboard's layout
        proto = layout_pb2.Layout()
        proto.ParseFromString(config.tensor_proto.string_val[0])
        assert {
            c.title: {ch.title: list(ch.multiline.tag) for ch in c.chart} for c in proto.category
        } == charts, name

        n = r["steps_timed"]
        series = {tag: acc.Scalars(tag) for tag in TB_TAGS}
        for tag, events in series.items():
            assert [e.step for e in events] == list(range(n)), (name, tag)
        values = {tag: [e.value for e in events] for tag, events in series.items()}
        approx = lambda x: pytest.approx(x, rel=1e-5)  # noqa: E731  (float32 events)
        assert values["time/step_ms"] == approx([1e3 * t for t in r["step_times_s"]])
        assert values["throughput/tokens_per_s"] == approx([tokens / t for t in r["step_times_s"]])
        assert tokens / statistics.median(r["step_times_s"]) == approx(r["tokens_per_s"])
        assert values["loss_metrics/global_avg_loss"] == approx(r["step_losses"])
        assert values["tp/comm_share_pct"] == approx([100 * r["comm_share"]] * n)
        assert values["tp/bytes_MiB"] == approx([r["volume_per_step"] / 2**20] * n)
        assert values["tp/collectives"] == [r["collectives_per_step"]] * n
        assert values["memory/peak_step_MiB"] == approx([r["peak_step_mem_mib"]] * n)
    acc = EventAccumulator(str(tb / "ratios"))
    acc.Reload()
    for k, val in summary["ratios"].items():
        assert acc.Scalars(f"ratios/{k}")[0].value == pytest.approx(val, rel=1e-5), k


def test_gemm_mode(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "boost_titan.cli",
            "bench",
            "--gemm",
            "--m-scale",
            "0.002",
            "--dtype",
            "float32",
            "--gemm-seconds",
            "0.01",  # the plans' GEMM lists are what is checked, not their rates
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "gemm.json").read_text())
    assert set(res["plans"]) == {"fullrank", "vanilla", "btp"}
    assert all(r["tflops"] > 0 for r in res["plans"].values())
    # vanilla's per-rank GEMMs at 7B/TP4 have reduction or output dims of r/T = 256
    assert any(g["k"] == 256 or g["n"] == 256 for g in res["plans"]["vanilla"]["gemms"])


@pytest.mark.slow
def test_bench_checkpointing_variants(tmp_path):
    out = tmp_path / "bench_ac"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "boost_titan.cli",
            "bench",
            "--smoke",
            "--variants",
            "ac",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "results.json").read_text())
    v = summary["variants"]
    # exact, timing-free facts: checkpointing keeps fewer activations; latent
    # checkpointing adds no collective while full AC re-runs the forward's
    assert v["btp-latent-ckpt"]["saved_activation_mib"] < v["btp"]["saved_activation_mib"]
    assert v["vanilla-full-ac"]["saved_activation_mib"] < v["vanilla"]["saved_activation_mib"]
    assert v["btp-latent-ckpt"]["collectives_per_step"] == v["btp"]["collectives_per_step"]
    assert v["btp-latent-ckpt"]["bytes_per_step"] == v["btp"]["bytes_per_step"]
    assert v["btp-full-ac"]["collectives_per_step"] > v["btp"]["collectives_per_step"]
    assert v["vanilla-full-ac"]["bytes_per_step"] > v["vanilla"]["bytes_per_step"]
    assert set(summary["checkpoint_efficiency"]) == {
        "btp-latent-ckpt",
        "btp-latent-ckpt-recompute-attn",
        "btp-full-ac",
        "vanilla-full-ac",
    }
    # keeping the attention outputs costs exactly them: per block the output
    # [b, s, d/T] and the log-sum-exp [b, h/T, s], fp32 (smoke: b 2, s 64, d 128, h 8, T 2)
    kept = (
        v["btp-latent-ckpt"]["saved_activation_mib"]
        - v["btp-latent-ckpt-recompute-attn"]["saved_activation_mib"]
    ) * 2**20
    assert kept == 2 * (2 * 64 * 64 + 2 * 4 * 64) * 4


def test_gemm_mode_honours_tp_batch_seq(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "boost_titan.cli",
            "bench",
            "--gemm",
            "--tp",
            "2",
            "--batch",
            "1",
            "--seq",
            "64",
            "--dtype",
            "float32",
            "--gemm-seconds",
            "0.01",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "gemm.json").read_text())
    assert (res["tp"], res["m"], res["batch"], res["seq"]) == (2, 64, 1, 64)
    # full-rank wq at TP2: column-parallel, 4096 -> 4096 / 2 per rank
    wq = next(g for g in res["plans"]["fullrank"]["gemms"] if g["gemm"] == "wq")
    assert (wq["m"], wq["k"], wq["n"]) == (64, 4096, 2048)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gemm", "--dim", "512"], "--dim 512 only apply to the training benchmark"),
        (["--gemm", "--compile"], "--compile applies to the training benchmark"),
        (["--compile", "--warmup", "0"], "--compile needs --warmup >= 1"),
        (["--tp", "0"], "--tp must be >= 1, got 0"),
        (
            ["--compile", "--compile-backend", "bogus"],
            "--compile-backend 'bogus' is not a torch.compile backend",
        ),
        (
            ["--variants", "fullrank (dense twin)"],
            "error: unknown benchmark variant 'fullrank (dense twin)' (renamed: use 'fullrank'); "
            "valid: btp, btp-sp, vanilla, fullrank, btp-ungrouped, btp-sync-norm, "
            "btp-latent-ckpt, btp-latent-ckpt-recompute-attn, btp-full-ac, vanilla-full-ac; "
            "groups: default, ac (boost-titan bench --help)\n",
        ),
        (["--variants", "btp,btp sp"], "variant 'btp sp' (renamed: use 'btp-sp'); valid: btp,"),
        (["--variants", "btp-compiled"], "(compiled twins come from --compile: use 'btp' with"),
        (["--variants", "btp,,vanilla"], "unknown benchmark variant ''; valid: btp,"),
    ],
)
def test_bench_refuses_flags_it_would_ignore(tmp_path, capsys, argv, message):
    from boost_titan.perf.bench import cli

    with pytest.raises(SystemExit) as e:
        cli.main(argv + ["--out", str(tmp_path)])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_variant_ids_are_one_cli_and_path_safe_spelling():
    """Ids are the --variants values, the results keys and the tb/<id>/ folders: no spaces,
    parentheses or brackets; groups expand in order, each id once; every pre-id name is
    refused naming its id."""
    import re

    from boost_titan.perf.bench import variants

    twins = [variants.compiled_name(n) for n in variants.VARIANTS]
    assert all(re.fullmatch(r"[a-z]+(-[a-z]+)*", n) for n in [*variants.VARIANTS, *twins])
    assert not set(twins) & set(variants.VARIANTS)
    assert set(variants.DESCRIPTIONS) == set(variants.VARIANTS)
    assert variants.resolve_variants("btp,fullrank") == ["btp", "fullrank"]
    assert variants.resolve_variants(" btp-sp , vanilla-full-ac ") == ["btp-sp", "vanilla-full-ac"]
    assert variants.resolve_variants("default") == list(variants.DEFAULT_VARIANTS)
    assert variants.resolve_variants("btp-full-ac,ac") == [
        "btp-full-ac",
        "btp",
        "btp-latent-ckpt",
        "btp-latent-ckpt-recompute-attn",
        "vanilla",
        "vanilla-full-ac",
    ]
    assert len(variants.RENAMED) == 8 and not set(variants.RENAMED) & set(variants.VARIANTS)
    for old, new in variants.RENAMED.items():
        assert new in variants.VARIANTS
        with pytest.raises(ValueError, match=re.escape(f"(renamed: use {new!r}); valid: btp,")):
            variants.resolve_variants(f"btp,{old}")


def test_bench_tp_needs_that_many_gpus(tmp_path, capsys, monkeypatch):
    import torch

    from boost_titan.perf.bench import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(SystemExit):
        cli.main(["--tp", "4", "--out", str(tmp_path)])
    assert "--tp 4 needs 4 GPUs; only 2 visible" in capsys.readouterr().err


def _raw(step: float, loss: float) -> dict:
    return {
        "step_times": [step, step],
        "rep_times": [step],
        "comm_times": [0.1 * step],
        "instrumented_step_times": [step],
        "bytes_per_step": 100,
        "volume_per_step": 100.0,
        "collectives_per_step": 3,
        "peak_step_mem_bytes": 2**20,
        "saved_activation_bytes": 2**20,
        "param_bytes_per_rank": 2**20,
        "warmup_times": [10 * step],
        "first_step_loss": loss,
        "graphs_compiled_in_timed_steps": 0,
    }


def test_summary_puts_compiled_beside_eager():
    from boost_titan.perf.bench import report, stats, variants

    raw = {
        "btp": _raw(0.2, 6.0),
        "btp-compiled": _raw(0.1, 6.0),
        "vanilla": _raw(0.4, 6.1),
        "vanilla-compiled": _raw(0.25, 6.1 * (1 + 3e-4)),
    }
    summary = stats.summarise(raw, variants.SMOKE, 2, "CPU", "inductor")
    comp = summary["compile"]["variants"]
    assert comp["btp"]["compiled_vs_eager_tokens_per_s"] == pytest.approx(2.0)
    assert comp["btp"]["compile_step_s"] == pytest.approx(1.0) and comp["btp"]["loss_match"]
    assert not comp["vanilla"]["loss_match"]
    ratios = summary["ratios"]
    assert ratios["btp_vs_vanilla_tokens_per_s"] == pytest.approx(2.0)
    assert ratios["btp_vs_vanilla_tokens_per_s_compiled"] == pytest.approx(2.5)
    assert ratios["btp_compiled_vs_eager_tokens_per_s"] == pytest.approx(2.0)
    [mismatch] = stats.loss_mismatches(summary)
    assert mismatch.startswith("vanilla: eager 6.100000")
    md = report.markdown(summary)
    assert "| btp-compiled |" in md and "**MISMATCH**" in md


def test_eager_summary_has_no_compile_section():
    from boost_titan.perf.bench import stats, variants

    summary = stats.summarise(
        {"btp": _raw(0.2, 6.0), "vanilla": _raw(0.4, 6.1)}, variants.SMOKE, 2, "CPU"
    )
    assert "compile" not in summary
    assert set(summary["ratios"]) == {"btp_vs_vanilla_tokens_per_s", "vanilla_vs_btp_volume"}


@pytest.mark.parametrize("smoke", [True, False])
def test_every_chart_title_names_the_run(smoke):
    """Both PNG charts carry a title naming what was measured, the layout and device,
    the shape, and a --smoke run as such (read from the figure the chart is saved from)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from boost_titan.perf.bench import report, stats, variants

    shape = variants.SMOKE if smoke else variants.Shape()
    device = "CPU (1 thread/rank, gloo)"
    summary = stats.summarise({"btp": _raw(0.2, 6.0), "vanilla": _raw(0.4, 6.1)}, shape, 2, device)
    shape_text = (
        f"d={shape.dim} f={shape.ffn_dim} r={shape.rank}, {shape.n_layers} layers, "
        f"batch {shape.batch} x seq {shape.seq}"
    )
    for build, what in (
        (report.step_time_figure, "training step time"),
        (report.comm_share_figure, "TP communication per step"),
    ):
        fig = build(summary)
        (ax,) = fig.axes
        title = ax.get_title()
        plt.close(fig)
        assert f"{what}\nTP2 on {device}\n" in title, title
        assert shape_text in title, title
        assert ("SMOKE RUN" in title) == smoke, title


def test_compile_twins_skip_what_the_trainer_refuses():
    from boost_titan.perf.bench import variants

    names, refused = variants.with_compiled(list(variants.AC_VARIANTS), tp=2)
    assert names[:2] == ["btp", "btp-compiled"]
    assert "btp-latent-ckpt-compiled" in names
    assert set(refused) == {"btp-latent-ckpt-recompute-attn", "btp-full-ac", "vanilla-full-ac"}
    assert variants.with_compiled(list(variants.AC_VARIANTS), tp=1)[1] == {}


@pytest.mark.slow
def test_bench_compile_smoke(tmp_path):
    out = tmp_path / "bench_c"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "boost_titan.cli",
            "bench",
            "--smoke",
            "--compile",
            # what this checks (the compiled twins' losses and profiled collectives
            # equal the eager ones) is Dynamo/AOTAutograd's; inductor's C++ builds
            # would add ~1 min cold (its code is checked by test_compile.py)
            "--compile-backend",
            "aot_eager",
            "--variants",
            "btp,vanilla",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "results.json").read_text())
    v = summary["variants"]
    assert list(v) == ["btp", "btp-compiled", "vanilla", "vanilla-compiled"]
    for name in ("btp", "vanilla"):
        c = summary["compile"]["variants"][name]
        assert c["loss_match"] and c["first_step_loss_rel_diff"] < 1e-4, c
        assert c["compile_step_s"] > 0 and c["compiled_tokens_per_s"] > 0
        # the compiled graphs issue exactly the eager step's collectives (profiler-counted)
        compiled = v[f"{name}-compiled"]
        keys = ("collectives_per_step", "bytes_per_step", "volume_per_step", "comm_by_op")
        assert [compiled[k] for k in keys] == [v[name][k] for k in keys]
    assert {"btp_vs_vanilla_tokens_per_s_compiled", "btp_compiled_vs_eager_tokens_per_s"} <= set(
        summary["ratios"]
    )
    assert "| btp-compiled |" in (out / "results.md").read_text()


@pytest.mark.slow
def test_gpu_check_smoke(tmp_path):
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.sh"
    out = tmp_path / "gpu_check"
    proc = subprocess.run(
        ["bash", str(script), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=1200,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| cola compiled |" in proc.stdout  # the markdown summary
    check_gpu_check_smoke(out)


def check_gpu_check_smoke(out) -> None:
    """Every section of a ``gpu_check.sh --smoke --out OUT`` run (CPU)."""
    from boost_titan.perf.gpu_check.common import Sizes
    from boost_titan.perf.gpu_check.trainer import check_log

    res = json.loads((out / "gpu_check.json").read_text())
    assert set(res) >= {
        "numerics",
        "tp2",
        "btp",
        "sdpa",
        "gemm",
        "throughput",
        "trainer",
        "memory",
        "versions",
        "peak_flops",
    }
    assert list(res["section_seconds"]) == [
        "numerics",
        "tp2",
        "btp",
        "sdpa",
        "gemm",
        "throughput",
        "trainer",
    ]
    import torch

    v = res["versions"]
    assert v["torch"] == torch.__version__ and v["torchtitan"] == "0.2.2"
    assert (v["cuda"], v["cudnn"], v["nccl"], v["driver"]) == (None, None, None, None)  # CPU
    assert res["peak_flops"]["value"] > 0 and "measured" in res["peak_flops"]["source"]
    assert res["throughput"]["peak_flops"] == res["peak_flops"]["value"]  # MFU's divisor
    for section in ("numerics", "tp2"):
        assert res[section]["archs"], section
        for arch, r in res[section]["archs"].items():
            assert (
                "error" not in r
                and r["ok"]
                and r["loss_max_rel_diff"] < 1e-4
                and r["grad_max_rel_diff"] < 1e-3
            ), (section, arch, r)
            assert len(r["eager_loss"]) == len(r["compiled_loss"]) == 2
    assert set(res["numerics"]["archs"]) == {"dense", "svd", "cola", "lax"}
    assert res["tp2"]["ran"] and res["tp2"]["archs"]["cola"]["plan"] == "btp"
    _check_gpu_check_btp(res["btp"])
    # CPU: the dispatcher's flash kernel for CPU, in fp32 and under bf16 autocast
    assert set(res["sdpa"]["archs"]) == {"dense", "svd", "cola", "lax"}
    for arch, r in res["sdpa"]["archs"].items():
        for dtype in ("float32", "bfloat16"):
            assert r[dtype]["kernel"] == "flash (CPU)", (arch, dtype, r)
            assert r[dtype]["aten_ops"] == [
                "aten::_scaled_dot_product_flash_attention_for_cpu",
                "aten::scaled_dot_product_attention",
            ]
    assert set(res["gemm"]["plans"]) == {"fullrank", "vanilla", "btp"}
    assert all(p["tflops"] > 0 for p in res["gemm"]["plans"].values())
    runs = res["throughput"]["runs"]
    assert set(runs) == {"cola eager", "cola compiled", "dense eager", "dense compiled"}
    for name, r in runs.items():
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] <= 1 and r["first_step_s"] > 0, name
    assert len(res["memory"]["peak_mem_mib"]) == 12
    assert all(m >= 0 for m in res["memory"]["peak_mem_mib"].values())
    # the trainer: 4 compiled steps, step 3's injected NaN skipped, steps 2 and 4 profiled
    t = res["trainer"]
    assert t["ok"] and t["returncode"] == 0 and t["problems"] == [], t
    assert list(t["losses"]) == ["1", "2", "3", "4"]
    assert math.isnan(t["losses"]["3"]) and t["guard_skipped_step"] == 3
    assert all(8 < t["losses"][s] < 10 for s in ("1", "2", "4"))  # ln(8192) = 9.01
    assert all(m > 0 for m in t["memory_gib"].values())
    assert all(t["tokens_per_s"][s] > 0 for s in ("1", "2", "4"))
    assert sorted(t["profiled_step_ms"]) == ["2", "4"]
    # the log checks see what is missing
    log = (out / "trainer.log").read_text()
    sizes = Sizes(trainer_steps=4, trainer_profile_freq=4)
    assert check_log(log, 0, sizes)["problems"] == []
    no_guard = "\n".join(ln for ln in log.splitlines() if "update skipped" not in ln)
    assert check_log(no_guard, 0, sizes)["problems"] == [
        "no step-guard skip logged for the NaN loss at step 3"
    ]
    assert check_log(log, 0, Sizes(trainer_steps=4, trainer_profile_freq=3))["problems"] == [
        "profiled steps [2, 4], expected [2, 3]"
    ]


def _check_gpu_check_btp(b: dict) -> None:
    """One graph for every CoLA block, two for LaX (block 0 has no crossing), at a depth
    past Dynamo's recompile limit; the statistic under inductor bitwise eager's and
    within 2^-16 of fp32 where plain bf16 is ~2^-9 off; eager == compiled. The statistic
    is compiled with inductor even in the smoke (one small graph, ~7 s): inductor's
    fusion, not aot_eager, is what once dropped the hi/lo rounding."""
    assert b["group"] == "1 rank (gloo)" and b["layers"] == 9 > 8
    s = b["statistic"]
    assert s["ok"] and s["bitwise_equal_eager"] and s["backend"] == "inductor", s
    assert s["max_rel_diff_vs_fp32"] <= 2.0**-16 < 2.0**-10 < s["plain_bf16_max_rel_diff"]
    assert set(b["archs"]) == {"cola", "lax"}
    for arch, graphs in (("cola", 1), ("lax", 2)):
        r = b["archs"][arch]
        assert r["ok"] and r["block_graphs"] == r["block_graphs_expected"] == graphs, (arch, r)
        assert r["loss_max_rel_diff"] <= b["loss_rtol"] and r["grad_max_rel_diff"] <= b["grad_rtol"]
        assert 6 < r["eager_loss"][0] < 7  # ln(512) = 6.24: the smoke's vocabulary


def test_gpu_check_refuses_without_cuda(tmp_path):
    """The full check (no --smoke) on a machine without CUDA: refused at once, exit 2,
    naming --smoke; nothing is run or written."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the full check would run")
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.sh"
    proc = subprocess.run(
        ["bash", str(script), "--out", str(tmp_path / "gc")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "boost-titan gpu-check: error: no CUDA device visible" in proc.stderr
    assert "add --smoke" in proc.stderr
    assert not (tmp_path / "gc").exists()


def _fake_results(**sections) -> dict:
    return {
        "device": "CPU",
        "torch": "2.13.0",
        "backend": "aot_eager",
        "smoke": True,
        "seconds": 1.0,
        "versions": {"torch": "2.13.0"},
        "peak_flops": {"value": 1e10, "source": "measured"},
        "section_seconds": dict.fromkeys(sections, 0.5),
        "memory": {"source": "peak RSS rise (CPU)", "peak_mem_mib": {}},
        **sections,
    }


def test_gpu_check_exit_status_names_the_failed_sections(tmp_path, capsys, monkeypatch):
    from boost_titan.perf.gpu_check import cli, report

    btp = {
        "group": "1 rank (gloo)",
        "layers": 9,
        "dtype": "bf16",
        "backend": "aot_eager",
        "loss_rtol": 1e-2,
        "grad_rtol": 5e-2,
        "statistic": {
            "ok": False,
            "bitwise_equal_eager": False,
            "max_rel_diff_vs_fp32": 3.8e-3,
            "plain_bf16_max_rel_diff": 3.8e-3,
            "rtol": 2.0**-16,
        },
        "archs": {"cola": {"error": "RuntimeError: cola: the blocks recompiled"}},
    }
    results = _fake_results(
        btp=btp,
        sdpa={"source": "x", "archs": {"dense": {"error": "RuntimeError: no SDPA op"}}},
        gemm={"error": "ValueError: boom"},
    )
    bad = report.failures(results)
    assert [s for s, _ in bad] == ["btp", "btp", "sdpa", "gemm"]
    assert "max rel diff vs fp32 3.80e-03" in bad[0][1]
    assert report.exit_status(["gemm", "sdpa"]) == 13 and report.exit_status([]) == 0

    monkeypatch.setattr(cli, "run", lambda *a, **k: results)
    with pytest.raises(SystemExit) as e:
        cli.main(["--smoke", "--out", str(tmp_path)])
    assert e.value.code == 12  # btp: SECTIONS index 2
    err = capsys.readouterr().err
    assert "gpu_check: FAILED sections: btp, sdpa, gemm" in err
    assert "gemm: ValueError: boom" in err
    assert json.loads((tmp_path / "gpu_check.json").read_text())["gemm"]["error"]


@pytest.mark.parametrize(
    "ops, kernels, cuda, backend",
    [
        (
            ["aten::_scaled_dot_product_flash_attention"],
            ["void pytorch_flash::flash_fwd_kernel<>"],
            True,
            "flash",
        ),
        (
            ["aten::_scaled_dot_product_efficient_attention"],
            ["fmha_cutlassF_f32_aligned_64x64_rf_sm80"],
            True,
            "efficient",
        ),
        (
            ["aten::_scaled_dot_product_cudnn_attention"],
            ["cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma"],
            True,
            "cudnn",
        ),
        (["aten::_scaled_dot_product_attention_math"], [], True, "math"),
        (["aten::_scaled_dot_product_flash_attention_for_cpu"], [], False, "flash (CPU)"),
        (["aten::_scaled_dot_product_attention_math"], [], False, "math"),
    ],
)
def test_gpu_check_sdpa_kernel_names(ops, kernels, cuda, backend):
    from boost_titan.perf.gpu_check.sdpa import classify

    assert classify(ops, kernels, cuda) == backend


class _KinetoEvent:
    """What the benchmark reads of torch's ``_KinetoEvent`` (times given in us): kernels
    are CUDA device events; NCCL's ``nccl:all_reduce`` range and the runtime's launch
    calls are host (CPU) events."""

    def __init__(self, name: str, start_us: float, end_us: float, device: bool = True):
        self._name, self._start, self._end, self._device = name, start_us, end_us, device

    def name(self):
        return self._name

    def device_type(self):
        from torch.autograd import DeviceType

        return DeviceType.CUDA if self._device else DeviceType.CPU

    def start_ns(self):
        return int(self._start * 1000)

    def end_ns(self):
        return int(self._end * 1000)


def _nccl_step() -> list[_KinetoEvent]:
    """One step's events: NCCL kernels on two streams overlapping by 100 us, one more
    later, under a GEMM and inside host ranges that take no device time."""
    return [
        _KinetoEvent("nccl:all_reduce", 0, 5000, device=False),
        _KinetoEvent("cudaLaunchKernel", 10, 20, device=False),
        _KinetoEvent("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 0, 300),
        _KinetoEvent("ncclDevKernel_AllGather_RING_LL", 200, 500),
        _KinetoEvent("sm90_xmma_gemm_f32f32", 0, 2000),
        _KinetoEvent("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 1000, 1100),
    ]


NCCL_STEP_S = (500 + 100) * 1e-6  # the union of the NCCL kernels' spans


def test_nccl_comm_time_is_device_kernel_time():
    from boost_titan.perf.bench.comm import device_comm_seconds

    assert device_comm_seconds(_nccl_step()) == pytest.approx(NCCL_STEP_S, rel=1e-12)
    assert device_comm_seconds([e for e in _nccl_step() if "Kernel" not in e.name()]) == 0.0


@pytest.mark.parametrize("compiled", [False, True])
def test_gpu_comm_time_comes_from_the_device(monkeypatch, compiled):
    """On NCCL a collective and its wait return at once (host time ~0): the benchmark's
    comm time of an eager or compiled variant is the profiled NCCL kernels' time, not
    the host's time in collective ops (here 5 ms of host time, 0.6 ms on the device)."""
    from types import SimpleNamespace

    import torch
    import torch.profiler

    from boost_titan.perf.bench import comm

    all_reduce = SimpleNamespace(
        name="_c10d_functional::all_reduce",
        cpu_parent=None,
        input_shapes=[[4, 8], [], []],
        input_dtypes=["float", "", ""],
        concrete_inputs=[None, "sum", "0"],
        cpu_time_total=5000.0,  # us on the host
    )
    asked = []

    class FakeProfile:
        def __init__(self, activities, **kw):
            asked.append(set(activities))
            results = SimpleNamespace(events=_nccl_step)
            self.profiler = SimpleNamespace(kineto_results=results)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return [all_reduce]

    monkeypatch.setattr(torch.profiler, "profile", FakeProfile)
    monkeypatch.setattr(comm, "sync", lambda device: None)
    monkeypatch.setattr(comm, "train_step", lambda *a, **kw: None)
    cuda = torch.device("cuda", 0)
    res = comm.measure_comm((None, None, None, None), compiled, 2, None, None, cuda)
    assert res.comm_times == pytest.approx([NCCL_STEP_S] * 2, rel=1e-12)
    assert len(res.step_times) == 2
    assert all(torch.profiler.ProfilerActivity.CUDA in a for a in asked) and asked
    if compiled:  # counted from the host ops as on CPU
        assert (res.collectives_per_step, res.bytes_per_step) == (1, 4 * 8 * 4)
