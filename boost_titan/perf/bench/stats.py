"""Statistics of a benchmark run: raw per-variant timings -> the summary in results.json
(medians, tokens/s, comm share, plan ratios, checkpointing efficiency, compiled vs eager).

Communication volume is stated in all-reduce-equivalent bytes (``volume_per_step``, the
planner's and the paper's convention,
``boost_titan.observability.comm_stats.allreduce_equivalent``: an
all-gather or reduce-scatter counts half its payload); ``bytes_per_step`` keeps the raw
counted payload."""

from __future__ import annotations

import os
import statistics

from boost_titan.perf.bench.variants import COMPILED, Shape, base_name, is_compiled

COMPILE_LOSS_RTOL = 1e-4  # compiled vs eager first-step loss, relative


def summarise(raw: dict, shape: Shape, world: int, device: str, backend: str | None = None) -> dict:
    tokens = shape.batch * shape.seq
    out = {"shape": shape.__dict__, "tp": world, "device": device, "variants": {}}
    for n, r in raw.items():
        out["variants"][n] = _variant_stats(r, tokens)
    v = out["variants"]
    compiled = any(is_compiled(n) for n in v)
    ratios = _plan_ratios(v, "", "")
    eff = _checkpoint_efficiency(v, raw, "")
    if eff:
        out["checkpoint_efficiency"] = eff
        ratios.update(_efficiency_ratio(eff, "", ""))
    if compiled:
        ratios.update(_plan_ratios(v, COMPILED, "_compiled"))
        eff_c = _checkpoint_efficiency(v, raw, COMPILED)
        if eff_c:
            out.setdefault("checkpoint_efficiency", {}).update(eff_c)
            ratios.update(_efficiency_ratio(eff_c, COMPILED, "_compiled"))
        out["compile"] = _compile_summary(raw, v, backend)
        for n, c in out["compile"]["variants"].items():
            ratios[f"{n}_compiled_vs_eager_tokens_per_s"] = c["compiled_vs_eager_tokens_per_s"]
    out["ratios"] = ratios
    return out


def _variant_stats(r: dict, tokens: int) -> dict:
    med = statistics.median(r["step_times"])
    share = (sum(r["comm_times"]) / sum(r["instrumented_step_times"])) if r["comm_times"] else 0.0
    return {
        "step_time_median_s": med,
        "step_time_min_s": min(r["step_times"]),
        "step_time_max_s": max(r["step_times"]),
        "steps_timed": len(r["step_times"]),
        "tokens_per_s": tokens / med,
        "comm_share": share,
        "step_times_s": list(r["step_times"]),
        "step_losses": list(r.get("step_losses", [])),
        "volume_per_step": r["volume_per_step"],  # all-reduce-equivalent bytes
        "bytes_per_step": r["bytes_per_step"],  # raw counted payload
        "comm_by_op": r.get("comm_by_op", {}),  # raw payload per op
        "collectives_per_step": r["collectives_per_step"],
        "peak_step_mem_mib": r["peak_step_mem_bytes"] / 2**20,
        "saved_activation_mib": r["saved_activation_bytes"] / 2**20,
        "param_mib_per_rank": r["param_bytes_per_rank"] / 2**20,
    }


def _plan_ratios(v: dict, suffix: str, key_suffix: str) -> dict:
    """The plan comparisons among the variants ``<id><suffix>`` (eager: "", compiled:
    COMPILED), keyed ``<ratio><key_suffix>``."""
    btp, vanilla, full = "btp" + suffix, "vanilla" + suffix, "fullrank" + suffix
    ungrouped, sync = "btp-ungrouped" + suffix, "btp-sync-norm" + suffix
    sp = "btp-sp" + suffix
    ratios = {}
    if btp in v and vanilla in v:
        ratios["btp_vs_vanilla_tokens_per_s"] = v[btp]["tokens_per_s"] / v[vanilla]["tokens_per_s"]
        ratios["vanilla_vs_btp_volume"] = v[vanilla]["volume_per_step"] / max(
            v[btp]["volume_per_step"], 1
        )
    if btp in v and full in v:
        ratios["btp_vs_fullrank_tokens_per_s"] = v[btp]["tokens_per_s"] / v[full]["tokens_per_s"]
        ratios["fullrank_vs_btp_volume"] = v[full]["volume_per_step"] / max(
            v[btp]["volume_per_step"], 1
        )
    if ungrouped in v:
        ratios["grouping_speedup"] = (
            v[ungrouped]["step_time_median_s"] / v[btp]["step_time_median_s"]
        )
    if sync in v:
        ratios["online_vs_sync_speedup"] = (
            v[sync]["step_time_median_s"] / v[btp]["step_time_median_s"]
        )
    if sp in v and btp in v:
        ratios["sp_vs_btp_step_time"] = v[sp]["step_time_median_s"] / v[btp]["step_time_median_s"]
        ratios["sp_vs_btp_volume"] = v[sp]["volume_per_step"] / max(v[btp]["volume_per_step"], 1)
        ratios["sp_vs_btp_saved_activations"] = v[sp]["saved_activation_mib"] / max(
            v[btp]["saved_activation_mib"], 1e-9
        )
    return {k + key_suffix: val for k, val in ratios.items()}


def _checkpoint_efficiency(v: dict, raw: dict, suffix: str) -> dict:
    """Activation checkpointing efficiency: activation memory saved per ms added. The
    added time is the median over repetitions of (AC variant - its base) within the
    repetition: the two ran back to back, so machine drift largely cancels."""
    eff = {}
    for ac_name, base in (
        ("btp-latent-ckpt", "btp"),
        ("btp-latent-ckpt-recompute-attn", "btp"),
        ("btp-full-ac", "btp"),
        ("vanilla-full-ac", "vanilla"),
    ):
        ac_name, base = ac_name + suffix, base + suffix
        if ac_name in v and base in v:
            saved_mb = (
                (v[base]["saved_activation_mib"] - v[ac_name]["saved_activation_mib"]) * 2**20 / 1e6
            )
            paired = [a - b for a, b in zip(raw[ac_name]["rep_times"], raw[base]["rep_times"])]
            added_ms = 1e3 * statistics.median(paired)
            eff[ac_name] = {
                "saved_mb": saved_mb,
                "added_ms": added_ms,
                "added_ms_per_rep": [1e3 * d for d in paired],
                # None: no added time measurable on this machine
                "mb_per_ms": saved_mb / added_ms if added_ms > 0 else None,
            }
    return eff


def _efficiency_ratio(eff: dict, suffix: str, key_suffix: str) -> dict:
    latent, full = "btp-latent-ckpt" + suffix, "vanilla-full-ac" + suffix
    if (
        latent in eff
        and full in eff
        and None not in (eff[latent]["mb_per_ms"], eff[full]["mb_per_ms"])
    ):
        return {
            "latent_ckpt_vs_vanilla_full_ac_efficiency" + key_suffix: eff[latent]["mb_per_ms"]
            / eff[full]["mb_per_ms"]
        }
    return {}


def _compile_summary(raw: dict, v: dict, backend: str | None) -> dict:
    """Per variant with a compiled twin: throughput both ways, the compiling step's
    time, and the first-step losses that must agree."""
    rows = {}
    for c in (n for n in v if is_compiled(n)):
        n = base_name(c)
        eager_loss, compiled_loss = raw[n]["first_step_loss"], raw[c]["first_step_loss"]
        rel = abs(compiled_loss - eager_loss) / max(abs(eager_loss), 1e-30)
        rows[n] = {
            "eager_tokens_per_s": v[n]["tokens_per_s"],
            "compiled_tokens_per_s": v[c]["tokens_per_s"],
            "compiled_vs_eager_tokens_per_s": v[c]["tokens_per_s"] / v[n]["tokens_per_s"],
            "compile_step_s": raw[c]["warmup_times"][0],  # the first, compiling step
            "eager_first_step_s": raw[n]["warmup_times"][0],
            "eager_first_step_loss": eager_loss,
            "compiled_first_step_loss": compiled_loss,
            "first_step_loss_rel_diff": rel,
            "loss_match": rel <= COMPILE_LOSS_RTOL,
            "graphs_compiled_in_timed_steps": raw[c]["graphs_compiled_in_timed_steps"],
        }
    return {
        "backend": backend,
        "loss_rtol": COMPILE_LOSS_RTOL,
        "inductor_cache_dir": _inductor_cache_dir(),
        "variants": rows,
    }


def _inductor_cache_dir() -> str:
    """Where the ranks cached their compiled graphs (a warm cache shortens the
    compiling step; TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) times a cold compile)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
    return os.path.join(base, "rank<R>")


def loss_mismatches(summary: dict) -> list[str]:
    """One line per compiled variant whose first-step loss is not its eager twin's."""
    rows = summary.get("compile", {}).get("variants", {})
    return [
        f"{n}: eager {c['eager_first_step_loss']:.6f}, "
        f"compiled {c['compiled_first_step_loss']:.6f} "
        f"(relative difference {c['first_step_loss_rel_diff']:.2e} > {COMPILE_LOSS_RTOL:g})"
        for n, c in rows.items()
        if not c["loss_match"]
    ]
