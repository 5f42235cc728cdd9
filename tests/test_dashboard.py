"""The BOOST dashboard (TensorBoard custom scalars) of a real run: present, grouped as
designed, and every chart resolving to scalars that the run really wrote."""

from __future__ import annotations

import re

import pytest
from helpers import run_training

from boost_titan.observability import dashboard, step_profile

CONFIG_TAG = "custom_scalars__config__"

# The design, spelled out once more: category -> chart title -> tags.
EXPECTED = {
    "loss": {
        "loss (train avg/max, validation)": [
            "loss_metrics/global_avg_loss",
            "loss_metrics/global_max_loss",
            "validation_metrics/loss",
        ]
    },
    "throughput": {
        "tokens/s": ["throughput/tokens_per_s"],
        "MFU and HFU (%)": ["throughput/mfu_pct", "throughput/hfu_pct"],
        "TFLOPs": ["tflops"],
    },
    "communication": {
        "TP comm share of the step (%)": ["tp/comm_share_pct"],
        "TP volume per step (MiB, all-reduce-equivalent)": ["tp/bytes_MiB"],
        "TP collectives per step": ["tp/collectives"],
        "other and exposed comm (ms)": ["comm/other_ms", "comm/exposed_ms"],
    },
    "step time": {
        "step, forward, backward, optimizer (ms)": [
            "time/step_ms",
            "time/forward_ms",
            "time/backward_ms",
            "time/optimizer_ms",
        ],
        "TP comm vs compute (ms)": [
            "tp/comm_forward_ms",
            "tp/compute_forward_ms",
            "tp/comm_backward_ms",
            "tp/compute_backward_ms",
        ],
        "profiler cost per profiled step (ms)": ["time/profiler_overhead_ms"],
    },
    "memory": {
        "max memory (GiB)": ["memory/max_reserved_GiB", "memory/max_active_GiB"],
        "max memory (%)": ["memory/max_reserved_pct", "memory/max_active_pct"],
    },
    "optimizer": {"grad norm": ["grad_norm"], "learning rate": ["lr"]},
}
PROFILED = {*step_profile.TAGS}


def read_event_file(path: str):
    """(scalar tag -> steps, [layout protos]) of one event file."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    acc = EventAccumulator(path, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = {tag: sorted(e.step for e in acc.Scalars(tag)) for tag in acc.Tags()["scalars"]}
    layouts = []
    if CONFIG_TAG in acc.Tags()["tensors"]:
        for ev in acc.Tensors(CONFIG_TAG):
            proto = layout_pb2.Layout()
            proto.ParseFromString(ev.tensor_proto.string_val[0])
            layouts.append(proto)
    return scalars, layouts


def layout_as_dict(proto) -> dict[str, dict[str, list[str]]]:
    return {c.title: {ch.title: list(ch.multiline.tag) for ch in c.chart} for c in proto.category}


def unresolved(charts: dict[str, dict[str, list[str]]], written: set[str]) -> list[str]:
    """Chart patterns that do not select exactly one written tag (TensorBoard: re.match)."""
    bad = []
    for titles in charts.values():
        for patterns in titles.values():
            for pat in patterns:
                if len([t for t in written if re.match(pat, t)]) != 1:
                    bad.append(pat)
    return bad


@pytest.fixture(scope="module")
def tb_run(corpus_dir, tmp_path_factory):
    run = run_training(
        "debug_cola.toml",
        1,
        tmp_path_factory.mktemp("dashboard"),
        "--training.steps",
        "3",
        "--validation.freq",
        "3",
        "--validation.steps",
        "1",
    )
    files = run.tb_event_files()
    assert len(files) == 1, files
    return (*read_event_file(files[0]), files[0])


@pytest.mark.slow
def test_run_writes_dashboard_once(tb_run):
    scalars, layouts, path = tb_run
    assert len(layouts) == 1, f"{len(layouts)} custom-scalars layouts in the event file"
    charts = layout_as_dict(layouts[0])
    # grouping as designed, each pattern selecting one tag by its exact name
    assert charts == {
        cat: {title: [dashboard.tag_regex(t) for t in tags] for title, tags in titles.items()}
        for cat, titles in EXPECTED.items()
    }
    # every referenced tag was written as a scalar by this run, and at the steps expected
    assert unresolved(charts, set(scalars)) == [], sorted(scalars)
    for _, _, tags in dashboard.CHARTS:
        for tag in tags:
            assert tag in scalars, f"{tag} is on the dashboard but not written: {sorted(scalars)}"
            # torchtitan validates at step 1 and every validation.freq steps; step 2 is
            # profiled (profile_freq 10); hfu needs a profiled step's FLOPs, so from step 3
            if tag.startswith("validation_"):
                assert scalars[tag] == [1, 3], tag
            elif tag in PROFILED:
                assert scalars[tag] == [2], tag
            elif tag == step_profile.HFU_TAG:
                assert scalars[tag] == [3], tag
            else:
                assert scalars[tag] == [1, 2, 3], tag
    # the paren-free aliases carry torchtitan's values exactly
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(path, size_guidance={"scalars": 0})
    acc.Reload()
    for original, alias in dashboard.ALIASES.items():
        assert [(e.step, e.value) for e in acc.Scalars(alias)] == [
            (e.step, e.value) for e in acc.Scalars(original)
        ], alias


def test_missing_tag_is_caught():
    """The check above fails when the layout names a tag the run did not write."""
    charts = {
        cat: {t: [dashboard.tag_regex(x) for x in tags] for t, tags in titles.items()}
        for cat, titles in EXPECTED.items()
    }
    written = {t for _, _, tags in dashboard.CHARTS for t in tags}
    assert unresolved(charts, written) == []
    assert unresolved(charts, written - {"lr"}) == [dashboard.tag_regex("lr")]
    # why patterns are escaped and anchored: raw names select nothing / too much
    assert not re.match("throughput(tps)", "throughput(tps)")
    assert re.match("lr", "lr_other") and not re.match(dashboard.tag_regex("lr"), "lr_other")


def test_layout_without_validation_and_with_prefix():
    assert dashboard.layout() == {
        cat: {t: ["Multiline", [dashboard.tag_regex(x) for x in tags]] for t, tags in ts.items()}
        for cat, ts in EXPECTED.items()
    }
    no_val = dashboard.layout(validation=False)
    assert no_val["loss"]["loss (train avg/max, validation)"][1] == [
        dashboard.tag_regex("loss_metrics/global_avg_loss"),
        dashboard.tag_regex("loss_metrics/global_max_loss"),
    ]
    tagged = dashboard.layout(prefix="ft")
    assert tagged["optimizer"]["learning rate"][1] == [dashboard.tag_regex("ft/lr")]
    # profiling off ([boost] profile_freq = 0): its charts go, MFU stays alone
    unprofiled = dashboard.layout(profiled=False)
    assert "communication" not in unprofiled and "step time" not in unprofiled
    assert unprofiled["throughput"]["MFU and HFU (%)"][1] == [
        dashboard.tag_regex("throughput/mfu_pct")
    ]
