"""The dry run (``boost-titan dryrun``) against real ranks, and every recipe
at its world size.

Ground truth: ``--measure`` builds the same config on real gloo ranks (forked with
torchrun's environment, tests/launcher.py), steps it on real tensors and measures what
the dry run traces: local parameter, gradient and optimizer-state bytes (real backward
and AdamW step), the bytes autograd saves for one microbatch per stage (saved-tensor
hooks, not MemTracker), and the collectives counted on the TP process group over a
whole step (every accumulation step; with PP through the real schedule). Exact
for all but activations; activations within 10% (the dry run also counts a non-last
stage's live output, which is not saved).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers import run_main

REPO = Path(__file__).resolve().parents[1]


def _dry(config: str, ngpu: int, *extra: str) -> subprocess.CompletedProcess:
    """``boost-titan dryrun --config config --ngpu ngpu extra``."""
    return run_main(
        "boost_titan.cli.main",
        "dryrun",
        "--config",
        config,
        "--ngpu",
        str(ngpu),
        *extra,
        env={"OMP_NUM_THREADS": "1"},
    )


def _json(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    return json.loads(proc.stdout[proc.stdout.index("{") :])


def _measured(config: str, ngpu: int, *extra: str) -> dict:
    """``torchrun --nproc-per-node ngpu -m boost_titan.perf.dryrun ... --measure --json``."""
    proc = run_main(
        "boost_titan.cli.main",
        "dryrun",
        "--config",
        config,
        "--ngpu",
        str(ngpu),
        "--measure",
        "--json",
        *extra,
        nproc=ngpu,
        env={"OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout[proc.stdout.index("{") :])  # only rank 0 prints


# global batch 8 = 2 accumulation steps of local batch 4 (TP2 and TP2 x PP2: DP 1)
_ACCUM2 = ("--training.global_batch_size", "8")


@pytest.mark.parametrize(
    "config,ngpu,extra",
    [
        ("train_configs/debug_cola_btp_tp2.toml", 2, _ACCUM2),
        ("train_configs/debug_cola_btp_tp2_fsdp2.toml", 4, ()),
        ("train_configs/debug_cola_btp_tp2_pp2_interleaved.toml", 4, _ACCUM2),
        ("train_configs/debug_lax_pp2.toml", 2, ()),
    ],
)
def test_dry_run_equals_real_ranks(config, ngpu, extra):
    """TP bytes and collectives per step: measured over a whole step on the real ranks
    (every accumulation step, through the real pipeline schedule), traced per
    microbatch and multiplied by the step's microbatches x accumulation steps."""
    dry, real = _json(_dry(config, ngpu, "--json", *extra)), _measured(config, ngpu, *extra)
    assert len(dry["roles"]) == len(real["roles"]) >= 1
    for d, r in zip(dry["roles"], real["roles"]):
        print(config, d["role"], "activations dry", d["stage_activation_bytes"], "real",
              r["stage_activation_bytes"])  # fmt: skip
        assert d["stages"] == r["stages"]
        for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "tp_bytes_per_step",
                    "tp_collectives_per_step"):  # fmt: skip
            assert d[key] == r[key], (key, d[key], r[key])
        assert d["params_bytes"] > 0 and d["optimizer_bytes"] >= 2 * d["params_bytes"]
        for a, b in zip(d["stage_activation_bytes"], r["stage_activation_bytes"]):
            assert abs(a - b) <= 0.1 * b, (a, b)
        # the saved bytes by block and role: measured, they are the stage activations
        # (the same saved-tensor hooks); traced, the same storages of fake tensors
        db, rb = d["activation_breakdown"], r["activation_breakdown"]
        print(config, d["role"], "breakdown dry", db, "real", rb)
        assert rb["saved_total"] == sum(r["stage_activation_bytes"])
        for b in (db, rb):
            assert sum(b["block_total"].values()) + b["stack_ends"] == b["saved_total"]
        assert (db["block_total"], db["stack_ends"], db["blocks"]) == (
            rb["block_total"],
            rb["stack_ends"],
            rb["blocks"],
        )
    if "tp2" in config:
        assert dry["roles"][0]["tp_collectives_per_step"] > 0
    if extra and "pp2" in config:
        # closed form: 2 accumulation steps carry twice the TP traffic of one (issue 29)
        one = _json(_dry(config, ngpu, "--json"))
        for d, o in zip(dry["roles"], one["roles"]):
            for key in ("tp_bytes_per_step", "tp_collectives_per_step"):
                assert d[key] == 2 * o[key], (key, d[key], o[key])


def _recipes() -> list[tuple[str, int, int]]:
    """(recipe, world size, pipeline degree) of every recipe."""
    from boost_titan.perf.recipes import LAYOUTS, all_recipes, recipe_name

    return [
        (f"recipes/{recipe_name(arch, size, optimizer)}.toml", LAYOUTS[size][2], LAYOUTS[size][1])
        for arch, size, optimizer in all_recipes()
    ]


def test_every_recipe_fits_at_its_world_size():
    """Every recipe builds, shards and fits an 80 GB GPU (10% headroom) at the world
    size it is written for (the long-context ones under CP2 and CP8 too): all 58 roles
    (one per pipeline rank) in one pool, one process per core, each forked from a
    server that imported torchtitan once (the CLI's JSON path is covered above and
    below)."""
    from boost_titan.perf.dryrun import fits
    from boost_titan.perf.recipes import _dry_runs

    recipes = _recipes()
    assert len(recipes) == 30 and all((REPO / r).is_file() for r, _, _ in recipes)
    reports = _dry_runs([(str(REPO / r), g) for r, g, _ in recipes])
    bad = []
    for (recipe, gpus, pp), roles in zip(recipes, reports):
        peak = max(r.peak_bytes for r in roles) / 2**30
        ok = fits(roles, 80.0, 0.1)
        print(f"{recipe} on {gpus}: {len(roles)} roles, peak {peak:.1f} GiB, fits {ok}")
        # every pipeline rank's role, each its own
        assert [r.role for r in roles] == (
            [f"PP rank {s}" for s in range(pp)] if pp > 1 else ["every rank"]
        ), recipe
        if not ok:
            bad.append((recipe, peak))
    assert not bad, bad
    assert sum(len(roles) for roles in reports) == 58


def test_too_big_layout_is_refused_with_the_figure():
    proc = _dry(
        "recipes/llama2_30b.toml",
        8,
        "--gpu-memory",
        "40",
        "--parallelism.tensor_parallel_degree",
        "1",
        "--parallelism.pipeline_parallel_degree",
        "1",
    )
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    # the recipe names a tokenizer this checkout lacks; a dry run reads none, and says nothing
    assert not (REPO / "assets" / "llama2_tokenizer").exists()
    assert "HF assets path" not in proc.stdout + proc.stderr, proc.stdout[-2000:]
    assert "does not fit: every rank needs" in proc.stderr
    assert "> 36.0 GiB (40 GiB less 10%)" in proc.stderr
    assert " NO" in proc.stdout


def test_bad_input_is_refused_when_parsed():
    proc = _dry("recipes/cola_llama2_7b.toml", 6)
    assert proc.returncode == 2
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("boost-titan dryrun: error: ") and "6" in line, proc.stderr[-2000:]
