"""The step-time model (boost_titan.perf.step_time), its hardware table, its calibration
(boost_titan.perf.calibration) and the layout search (boost_titan.perf.search, ``plan
--search``).

Each term of the model is checked against a closed form computed here by hand from
the model's shapes (not by calling the model's own helpers); the calibration must
order full-rank / vanilla / BOOST as the paper does at every published point; the
search on the debug model must return a layout whose written recipe passes the dry
run."""

from __future__ import annotations

import json
import re

import pytest
from helpers import run_main

from boost_titan.perf import calibration as perf_calibration
from boost_titan.perf import hardware
from boost_titan.perf import step_time as perf_model
from boost_titan.perf.step_time import Efficiency, Layout, ring_time, step_time

EFF = Efficiency(gemm=0.7, hbm=0.6, link=0.5, alpha_s=1e-5)


def _args(arch: str = "cola", flavor: str = "7b"):
    from boost_titan.models.flavors import flavors_for

    return flavors_for(arch)[flavor]


def test_ring_collectives_closed_form():
    B, bw, a = 3e8, 1e11, 1e-5
    assert ring_time("all_reduce", B, 4, bw, a) == pytest.approx(2 * 3 / 4 * B / bw + 2 * 3 * a)
    assert ring_time("all_gather", B, 8, bw, a) == pytest.approx(7 / 8 * B / bw + 7 * a)
    assert ring_time("reduce_scatter", B, 2, bw, a) == pytest.approx(B / 2 / bw + a)
    assert ring_time("all_reduce", B, 1, bw, a) == 0.0


def test_gemm_roofline_adds_math_and_traffic():
    hw = hardware.gpu("a100-80")
    m, k, n = 16384, 1024, 4096
    t = perf_model.gemm_time(m, k, n, hw, EFF)
    math_s = 2 * m * k * n / (0.7 * 312e12)
    traffic_s = 2 * (m * k + k * n + m * n) / (0.6 * 2039e9)
    assert t == pytest.approx(math_s + traffic_s)
    # thin reduction dims (vanilla's r/T) reach less of the peak than BTP's
    rate = lambda k: 2 * m * k * n / perf_model.gemm_time(m, k, n, hw, EFF)  # noqa: E731
    assert rate(256) < 0.8 * rate(4096)


def test_btp_tp_term_is_four_allreduces_of_latents_each_way():
    """BTP per block: forward all-reduces of t(3r + 2T), t r, t(2r + 2T), t r (bf16
    Online-RMSNorm statistics: 2T columns), backward t r, 2t r, t r, 3t r; on an NVSwitch
    node at e_link x NVLink/2 per direction; 32 blocks plus the stack ends' gather and
    reduce-scatter of [t, d] each way."""
    a, hw = _args(), hardware.gpu("h100-80")
    T, b, s = 4, 4, 4096
    t, r, d = b * s, a.rank, a.dim
    bw = 0.5 * 900e9 / 2
    ar = lambda n: 2 * (T - 1) / T * n * 2 / bw + 2 * (T - 1) * 1e-5  # noqa: E731
    half = lambda n: (T - 1) / T * n * 2 / bw + (T - 1) * 1e-5  # noqa: E731
    fwd = ar(t * (3 * r + 2 * T)) + ar(t * r) + ar(t * (2 * r + 2 * T)) + ar(t * r)
    bwd = ar(t * r) + ar(2 * t * r) + ar(t * r) + ar(3 * t * r)
    ends = 2 * (half(t * d) + half(t * d))
    bd = step_time(a, Layout("btp", tp=T, micro_batch=b, seq=s), hw, EFF)
    assert bd.terms["TP collectives (exposed)"] == pytest.approx(32 * (fwd + bwd) + ends)


def test_vanilla_runs_every_head_and_btp_a_quarter():
    a, hw = _args(), hardware.gpu("h100-80")
    flash = 3.5 * 0.5 * 4 * 4 * 4096**2 * a.dim * 32 / (0.7 * 989.5e12)  # all heads, 32 blocks
    van = step_time(a, Layout("vanilla", tp=4), hw, EFF).terms["attention (flash, fwd + bwd)"]
    btp = step_time(a, Layout("btp", tp=4), hw, EFF).terms["attention (flash, fwd + bwd)"]
    assert van == pytest.approx(flash)
    assert btp == pytest.approx(flash / 4)


def test_pipeline_bubble_and_microbatches():
    a, hw = _args(), hardware.gpu("h100-80")
    per_mb_terms = (
        "GEMMs (fwd + 2x bwd)",
        "attention (flash, fwd + bwd)",
        "elementwise (HBM-bound)",
        "TP collectives (exposed)",
        "recompute (checkpointing)",
    )
    for sched, v, n_mb, bubble in (("1F1B", 1, 8, 3), ("Interleaved1F1B", 2, 8, 1.5)):
        bd = step_time(
            a,
            Layout("btp", tp=2, pp=4, microbatches=n_mb, schedule=sched, stages_per_rank=v),
            hw,
            EFF,
        )
        work = sum(bd.terms[k] for k in per_mb_terms)
        assert bd.terms["PP bubble"] == pytest.approx(bubble * work / n_mb), sched
    one = step_time(a, Layout("btp", tp=2, pp=4, microbatches=1), hw, EFF)
    assert one.terms["PP bubble"] == pytest.approx(3 * sum(one.terms[k] for k in per_mb_terms))


def test_full_recompute_is_one_more_forward_of_every_block():
    """Dense, TP 1: full AC re-runs each block's forward = a third of the blocks'
    GEMM and elementwise time (forward 1 of 3) and 1/3.5 of attention's."""
    a, hw = _args("dense"), hardware.gpu("a100-80")
    none = step_time(a, Layout("fullrank", tp=1), hw, EFF)
    full = step_time(a, Layout("fullrank", tp=1, checkpoint="full"), hw, EFF)
    t, d, V = 4 * 4096, a.dim, a.vocab_size
    head = 3 * (2 * t * d * V / (0.7 * 312e12) + 2 * (t * d + d * V + t * V) / (0.6 * 2039e9))
    loss = t * V * 24 / (0.6 * 2039e9)
    expect = (
        (none.terms["GEMMs (fwd + 2x bwd)"] - head) / 3
        + none.terms["attention (flash, fwd + bwd)"] / 3.5
        + (none.terms["elementwise (HBM-bound)"] - loss) / 3
    )
    assert full.terms["recompute (checkpointing)"] == pytest.approx(expect)
    mlp = step_time(a := _args(), Layout("btp", tp=4, checkpoint="mlp"), hw, EFF)
    both = step_time(a, Layout("btp", tp=4, checkpoint="both"), hw, EFF)
    assert 0 < mlp.terms["recompute (checkpointing)"] < both.terms["recompute (checkpointing)"]


def test_fsdp_hidden_when_fast_exposed_when_slow():
    """FSDP over 8 nodes (TP 8 fills each): per block the bf16 all-gather and the fp32
    reduce-scatter go over the network; behind compute only the first gather, the
    last reduce-scatter and the stack ends' show; on a slow network each block's
    excess shows too."""
    from boost_titan.perf.plan import params_per_rank

    a = _args()
    fast = hardware.GPU("fast", 989.5e12, 3.35e12, 80, 900e9, 400e9 * 100)
    slow = hardware.GPU("slow", 989.5e12, 3.35e12, 80, 900e9, 1e9)
    lay = Layout("btp", tp=8, dp_shard=8, gpus_per_node=8)
    P = params_per_rank(a, "btp", 8)
    ends = 2 * a.vocab_size * a.dim / 8 + a.dim
    blk = (P - ends) / a.n_layers

    def ring(op, nbytes, bw):
        return ring_time(op, nbytes, 8, bw, 1e-5)

    bw = 0.5 * 400e9 * 100 / 8
    expect = (
        ring("all_gather", 2 * blk, bw)
        + ring("reduce_scatter", 4 * blk, bw)
        + ring("all_gather", 2 * ends, bw)
        + ring("reduce_scatter", 4 * ends, bw)
    )
    got = step_time(a, lay, fast, EFF).terms["FSDP/HSDP comm (exposed)"]
    assert got == pytest.approx(expect)
    slow_t = step_time(a, lay, slow, EFF).terms["FSDP/HSDP comm (exposed)"]
    gather_all = 32 * 2 * ring("all_gather", 2 * blk, 0.5 * 1e9 / 8)  # forward and backward
    assert slow_t > gather_all


def test_context_parallel_terms_closed_form():
    """CP4 x TP4 of CoLA 7B at 32k over 4 nodes of 4 GPUs (CP's group leaves the node):
    every per-token term is CP1's at 8k tokens, attention 1/4 of CP1's at 32k, FSDP
    shards over cp; the ring (K/V all-gathered forward and again backward, fp32 dK/dV
    passed cp - 1 hops) is exposed beyond the attention tile it overlaps."""
    a = _args()
    hw = hardware.GPU("slow", 989.5e12, 3.35e12, 80, 900e9, 8e9, gpus_per_node=4)
    kw = dict(tp=4, micro_batch=1, gpus_per_node=4)
    cp4 = step_time(a, Layout("btp", cp=4, seq=32768, **kw), hw, EFF)
    short = step_time(a, Layout("btp", seq=8192, dp_shard=4, **kw), hw, EFF)
    long = step_time(a, Layout("btp", seq=32768, **kw), hw, EFF)
    for term in ("GEMMs (fwd + 2x bwd)", "elementwise (HBM-bound)", "TP collectives (exposed)"):
        assert cp4.terms[term] == pytest.approx(short.terms[term]), term
    key = "attention (flash, fwd + bwd)"
    assert cp4.terms[key] == pytest.approx(long.terms[key] / 4)
    assert cp4.terms["optimizer (AdamW)"] == pytest.approx(short.terms["optimizer (AdamW)"])
    assert cp4.layout.tokens_per_step == 32768 and cp4.layout.world == 16
    t, kv_w = 8192, 4096 // 4  # tokens per rank; K/V columns per TP rank (MHA)
    kv = 2 * t * kv_w
    bw = 0.5 * 8e9 / 8  # e_link x the network's bytes/s: the group spans 16 ranks
    gather = 3 * kv * 2 / bw + 3 * 1e-5
    hop = kv * 4 / bw + 1e-5
    attn = 0.5 * 4 * 32768**2 * (32 / 4) * 128 / 4 / (0.7 * 989.5e12)
    tile_f, tile_b = attn / 4, 2.5 * attn / 4
    per_block = max(0, gather - tile_f) + max(0, gather - tile_b) + 3 * max(0, hop - tile_b)
    assert per_block > 0  # the slow network shows
    assert cp4.terms["CP ring attention (exposed)"] == pytest.approx(32 * per_block)
    assert cp4.ring_bytes_per_step == pytest.approx(32 * (2 * 3 * kv * 2 + 3 * kv * 4))
    assert long.terms["CP ring attention (exposed)"] == 0.0 and long.ring_bytes_per_step == 0
    with pytest.raises(ValueError, match="seq 32760: must be divisible by 2 x cp 4 x tp 4"):
        step_time(a, Layout("btp", cp=4, seq=32760, **kw), hw, EFF)


def test_calibration_orders_plans_as_the_paper_at_every_point():
    cal = perf_calibration.calibration()
    assert len(cal["rows"]) == 16 and len(cal["order"]) == 6
    for group, o in cal["order"].items():
        assert o["ok"], (group, o)
    fitted = [r for r in cal["rows"] if r["fitted"]]
    assert len(fitted) == 10
    # the fit's figures as the docs quote them (docs/layout-search.md)
    assert sum(abs(r["error"]) for r in fitted) / 10 < 0.06
    assert sum(abs(r["loo_error"]) for r in fitted) / 10 < 0.09
    for e in cal["efficiency"]["gemm"], cal["efficiency"]["hbm"], cal["efficiency"]["link"]:
        assert 0.3 < e < 1.0


def test_refit_on_a_gpu_check_file_recovers_its_efficiency(tmp_path):
    """A synthetic gpu_check.json whose GEMM rates an H100 at e_gemm 0.62, e_hbm 0.55
    would give: the refit finds both; the GPU comes from versions.gpus."""
    hw = hardware.gpu("h100-80")
    truth = Efficiency(gemm=0.62, hbm=0.55)
    shapes = [(16384, 4096, 1024), (16384, 256, 4096), (16384, 1024, 2752), (4096, 4096, 4096)]
    gemms = [
        dict(m=m, k=k, n=n, tflops=2 * m * k * n / perf_model.gemm_time(m, k, n, hw, truth) / 1e12)
        for m, k, n in shapes
    ]
    path = tmp_path / "gpu_check.json"
    path.write_text(
        json.dumps(
            {
                "versions": {"gpus": ["NVIDIA H100 80GB HBM3"]},
                "gemm": {"plans": {"btp": {"gemms": gemms}}},
            }
        )
    )
    got_hw, eff, report = perf_calibration.calibrate_from_gpu_check(str(path))
    assert got_hw.name == "h100-80"
    assert eff.gemm == pytest.approx(0.62, rel=1e-3) and eff.hbm == pytest.approx(0.55, rel=1e-3)
    assert "e_gemm 0.620" in report
    (tmp_path / "bad.json").write_text(json.dumps({"versions": {}}))
    with pytest.raises(ValueError, match="no 'gemm' section"):
        perf_calibration.calibrate_from_gpu_check(str(tmp_path / "bad.json"))


@pytest.mark.parametrize(
    "body, message",
    [
        ("name = 'x'\npeak_bf16_flops = 1e15\n", "missing key 'hbm_bytes_per_s'"),
        (
            "name='x'\npeak_bf16_flops=1e15\nhbm_bytes_per_s=-3\nmemory_gib=80\n"
            "nvlink_bytes_per_s=9e11\ninternode_bits_per_s=4e11\n",
            "hbm_bytes_per_s = -3 must be a positive number",
        ),
        ("name='x'\nspeed=3\n", "unknown key 'speed'"),
        ("name = \n", "not valid TOML"),
    ],
)
def test_custom_gpu_toml_errors_are_one_line(tmp_path, body, message):
    path = tmp_path / "gpu.toml"
    path.write_text(body)
    with pytest.raises(ValueError, match=message) as e:
        hardware.load_gpu_file(str(path))
    assert "\n" not in str(e.value)


def test_custom_gpu_toml_loads_and_unknown_gpu_is_refused(tmp_path):
    path = tmp_path / "gpu.toml"
    path.write_text(
        "[gpu]\nname = 'b200ish'\npeak_bf16_flops = 2.25e15\nhbm_bytes_per_s = 8e12\n"
        "memory_gib = 180\nnvlink_bytes_per_s = 1.8e12\ninternode_bits_per_s = 4e11\n"
    )
    g = hardware.load_gpu_file(str(path))
    assert (g.peak_bf16_flops, g.memory_gib, g.nvlink_one_way, g.gpus_per_node) == (
        2.25e15,
        180.0,
        0.9e12,
        8,
    )
    with pytest.raises(ValueError, match=r"unknown GPU 'v100'; valid: \['a100-40'"):
        hardware.gpu("v100")


def _search_small_gpu(tmp_path, seq: int, memory_gib: int):
    """``plan --search`` for the debug CoLA model on 4 ranks of a small custom GPU,
    then ``boost-titan dryrun`` of the recipe it wrote; (search stdout, stderr, recipe)."""
    gpu = tmp_path / "small.toml"
    gpu.write_text(
        f"name = 'small'\npeak_bf16_flops = 1e14\nhbm_bytes_per_s = 1e12\n"
        f"memory_gib = {memory_gib}\nnvlink_bytes_per_s = 2e11\ninternode_bits_per_s = 1e11\n"
        "gpus_per_node = 4\n"
    )
    recipe = tmp_path / "found.toml"
    proc = run_main(
        "boost_titan.cli.main",
        "plan",
        "--search",
        "--model",
        "cola_llama2",
        "--flavor",
        "debugmodel",
        "--gpus",
        "4",
        "--gpu-file",
        str(gpu),
        "--seq",
        str(seq),
        "--global-batch-tokens",
        str(16 * seq),
        "--top",
        "3",
        "--write",
        str(recipe),
        env={"OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dry run of the winner" in proc.stderr and "fits" in proc.stderr
    dry = run_main(
        "boost_titan.cli.main",
        "dryrun",
        "--config",
        str(recipe),
        "--ngpu",
        "4",
        "--gpu-memory",
        str(memory_gib),
        env={"OMP_NUM_THREADS": "1"},
    )
    assert dry.returncode == 0, dry.stdout + dry.stderr[-2000:]
    return proc.stdout, proc.stderr, recipe.read_text()


def test_search_picks_context_parallel_for_a_long_sequence_and_its_recipe_passes(tmp_path):
    """The search ranks every layout, traces the memory of those it reaches, checks the
    winner by the full dry run, writes it; the recipe then passes ``boost-titan dryrun``.
    At 16k tokens on 2 GiB GPUs no layout without CP fits (the full dry run refuses the
    fastest, FSDP4 at 2.3 GiB): the winner splits the sequence over 2 ranks, its recipe
    says so; the ring's bytes are in the breakdown."""
    out, err, text = _search_small_gpu(tmp_path, 16384, 2)
    rows = [line for line in out.splitlines() if line[:3].strip().isdigit()]
    assert 1 <= len(rows) <= 3  # a first that its full dry run refuses is dropped
    rates = [float(re.search(r" ([\d,]{4,}) ", line).group(1).replace(",", "")) for line in rows]
    assert rates == sorted(rates, reverse=True)
    assert 'extends = "' in text and "[parallelism]" in text
    winner = next(line for line in out.splitlines() if line.startswith("winner on"))
    assert "CP2" in winner, out
    assert "context_parallel_degree = 2" in text and "seq_len = 16384" in text
    assert "does NOT fit; next" in err  # the estimate's first choice, refused by the dry run
    assert re.search(r"CP ring bytes per step per rank [1-9]", out), out


def test_short_sequences_rank_no_context_parallelism():
    """Below 16k tokens the search enumerates no CP degree; from it, only those whose
    shards split the sequence in 2 x cp x tp."""
    from boost_titan.perf.search.layouts import enumerate_layouts

    a = _args(flavor="debugmodel")
    assert {lay.cp for lay in enumerate_layouts(a, 4, 4, 2048, 16)} == {1}
    long = enumerate_layouts(a, 4, 4, 16384, 16)
    assert {lay.cp for lay in long} == {1, 2, 4}
    assert all(16384 % (2 * lay.cp * lay.tp) == 0 and lay.world == 4 for lay in long)


def test_search_refuses_bad_input_in_one_line():
    proc = run_main(
        "boost_titan.cli.main",
        "plan",
        "--search",
        "--flavor",
        "7b",
        "--gpus",
        "12",
        "--gpu",
        "h100-80",
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "boost-titan plan: error: --gpus 12: must be >= 1 and, beyond one node, a multiple of 8"
    ]
    proc = run_main("boost_titan.cli.main", "plan", "--search", "--gpu", "v100")
    assert proc.returncode == 2 and "unknown GPU 'v100'" in proc.stderr
