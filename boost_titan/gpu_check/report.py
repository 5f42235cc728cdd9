"""The report: what failed (``failures``, the exit status) and the markdown summary
printed at the end (``markdown``)."""

from __future__ import annotations

from boost_titan.gpu_check.common import GRAD_RTOL, LOSS_RTOL, SECTIONS


def failures(results: dict) -> list[str]:
    """One line per section that failed and per architecture whose compiled run
    failed or does not match eager."""
    out = [
        f"{name}: {section['error']}"
        for name, section in results.items()
        if isinstance(section, dict) and "error" in section
    ]
    for section in ("numerics", "tp2"):
        for arch, row in results.get(section, {}).get("archs", {}).items():
            if "error" in row:
                out.append(f"{section} {arch}: {row['error']}")
            elif not row["ok"]:
                out.append(
                    f"{section} {arch}: "
                    f"loss rel diff {row['loss_max_rel_diff']:.2e} (max {LOSS_RTOL:g}), "
                    f"grad rel diff {row['grad_max_rel_diff']:.2e} (max {GRAD_RTOL:g})"
                )
    return out


def markdown(results: dict) -> str:
    lines = [
        f"# GPU check: {results['device']}, torch {results['torch']}, {results['backend']}"
        f"{' (smoke)' if results['smoke'] else ''}, {results['seconds']:.0f} s",
        "",
    ]
    for name in SECTIONS:
        if "error" in results.get(name, {}):
            lines += [f"{name}: **ERROR** {results[name]['error']}", ""]
    if "archs" in results.get("numerics", {}):
        lines += _numerics_md("Eager vs compiled, one device, fp32", results["numerics"])
    if "ran" in results.get("tp2", {}):
        tp = results["tp2"]
        if tp["ran"]:
            lines += _numerics_md(f"Eager vs compiled, TP2 on {tp['ranks']}, fp32", tp)
        else:
            lines += [f"TP2 skipped: {tp['reason']}; {tp['note']}", ""]
    if "plans" in results.get("gemm", {}):
        lines += _gemm_md(results["gemm"])
    if "runs" in results.get("throughput", {}):
        lines += _throughput_md(results["throughput"])
    lines += [f"Peak memory source: {results['memory']['source']}"]
    return "\n".join(lines) + "\n"


def _gemm_md(g: dict) -> list[str]:
    lines = [f"Per-rank block GEMMs, {g['flavor']} TP{g['tp']}, m = {g['m']}, {g['dtype']}:", ""]
    lines += [
        f"- {plan}: {r['tflops']:.2f} TFLOP/s ({r['block_gemm_time_s'] * 1e3:.2f} ms per block)"
        for plan, r in g["plans"].items()
    ]
    return lines + [""]


def _throughput_md(t: dict) -> list[str]:
    lines = [
        f"Throughput, {t['flavor']}, {t['dtype']}, batch {t['batch']} x seq {t['seq']}, "
        f"{t['steps']} steps after {t['warmup']} warm-up (MFU vs {t['peak_flops']:.3g} FLOP/s, "
        f"{t['peak_flops_source']}):",
        "",
        "| run | first step s | step s (median) | tokens/s | MFU | peak MiB |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in t["runs"].items():
        lines.append(
            f"| {name} | {r['first_step_s']:.1f} | {r['step_time_median_s']:.4f} "
            f"| {r['tokens_per_s']:.0f} "
            f"| {100 * r['mfu']:.1f}% | {r['peak_mem_mib']:.0f} |"
        )
    lines += [""] + [f"- {k}: {v:.3g}" for k, v in t["ratios"].items()]
    recompiled = [n for n, r in t["runs"].items() if r["graphs_compiled_in_timed_steps"]]
    if recompiled:
        lines.append(
            f"- Warning: graphs compiled during the timed steps of {recompiled} (raise --warmup)"
        )
    return lines + [""]


def _numerics_md(title: str, section: dict) -> list[str]:
    lines = [
        f"{title} (loss max rel diff <= {LOSS_RTOL:g}, grads <= {GRAD_RTOL:g}):",
        "",
        "| arch | loss eager / compiled (step 1) | loss rel diff | grad rel diff "
        "| compile step s | ok |",
        "|---|---|---|---|---|---|",
    ]
    for arch, r in section["archs"].items():
        if "error" in r:
            lines.append(f"| {arch} | **ERROR** {r['error'][:200]} | | | | **NO** |")
            continue
        plan = f" ({r['plan']})" if "plan" in r else ""
        lines.append(
            f"| {arch}{plan} | {r['eager_loss'][0]:.6f} / {r['compiled_loss'][0]:.6f} "
            f"| {r['loss_max_rel_diff']:.1e} | {r['grad_max_rel_diff']:.1e} "
            f"| {r['compile_step_s']:.1f} "
            f"| {'yes' if r['ok'] else '**NO**'} |"
        )
    return lines + [""]
