"""The report: what failed (``failures``, the exit status) and the markdown summary
printed at the end (``markdown``)."""

from __future__ import annotations

from boost_titan.perf.gpu_check.common import GRAD_RTOL, LOSS_RTOL, SECTIONS


def failures(results: dict) -> list[tuple[str, str]]:
    """(section, what) for every section that failed, every architecture whose
    compiled run failed or does not match eager, and every failed check, in
    ``SECTIONS`` order."""
    out = [
        (name, results[name]["error"])
        for name in SECTIONS
        if isinstance(results.get(name), dict) and "error" in results[name]
    ]
    for section in ("numerics", "tp2"):
        for arch, row in results.get(section, {}).get("archs", {}).items():
            if "error" in row:
                out.append((section, f"{arch}: {row['error']}"))
            elif not row["ok"]:
                out.append(
                    (
                        section,
                        f"{arch}: loss rel diff {row['loss_max_rel_diff']:.2e} "
                        f"(max {LOSS_RTOL:g}), grad rel diff {row['grad_max_rel_diff']:.2e} "
                        f"(max {GRAD_RTOL:g})",
                    )
                )
    out += _btp_failures(results.get("btp", {}))
    for arch, row in results.get("sdpa", {}).get("archs", {}).items():
        if "error" in row:
            out.append(("sdpa", f"{arch}: {row['error']}"))
    trainer = results.get("trainer", {})
    out += [("trainer", p) for p in trainer.get("problems", [])]
    order = {name: i for i, name in enumerate(SECTIONS)}
    return sorted(out, key=lambda f: order[f[0]])  # stable: each section's lines in order


def _btp_failures(btp: dict) -> list[tuple[str, str]]:
    out = []
    stat = btp.get("statistic", {})
    if "error" in stat:
        out.append(("btp", f"statistic: {stat['error']}"))
    elif stat and not stat["ok"]:
        out.append(
            (
                "btp",
                f"statistic under inductor: bitwise equal to eager {stat['bitwise_equal_eager']}, "
                f"max rel diff vs fp32 {stat['max_rel_diff_vs_fp32']:.2e} "
                f"(max {stat['rtol']:.2e}; a collapsed hi/lo split gives "
                f"{stat['plain_bf16_max_rel_diff']:.2e})",
            )
        )
    for arch, row in btp.get("archs", {}).items():
        if "error" in row:
            out.append(("btp", f"{arch}: {row['error']}"))
        elif not row["ok"]:
            out.append(
                (
                    "btp",
                    f"{arch}: {row['block_graphs']} compiled graphs for "
                    f"{btp['layers']} blocks (expected {row['block_graphs_expected']}), "
                    f"loss rel diff {row['loss_max_rel_diff']:.2e} (max {btp['loss_rtol']:g}), "
                    f"grad rel diff {row['grad_max_rel_diff']:.2e} (max {btp['grad_rtol']:g})",
                )
            )
    return out


def exit_status(failed_sections: list[str]) -> int:
    """10 + the index in ``SECTIONS`` of the first failed section (0: none failed)."""
    if not failed_sections:
        return 0
    return 10 + min(SECTIONS.index(s) for s in failed_sections)


def markdown(results: dict) -> str:
    v = results["versions"]
    lines = [
        f"# GPU check: {results['device']}, torch {results['torch']}, {results['backend']}"
        f"{' (smoke)' if results['smoke'] else ''}, {results['seconds']:.0f} s",
        "",
        "Versions: " + ", ".join(f"{k} {v[k]}" for k in v if k != "gpus"),
        f"Peak FLOP/s for MFU: {results['peak_flops']['value']:.4g} "
        f"({results['peak_flops']['source']})",
        "Section seconds: "
        + ", ".join(f"{k} {t:.0f}" for k, t in results["section_seconds"].items()),
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
    if "archs" in results.get("btp", {}):
        lines += _btp_md(results["btp"])
    if "archs" in results.get("sdpa", {}):
        lines += _sdpa_md(results["sdpa"])
    if "plans" in results.get("gemm", {}):
        lines += _gemm_md(results["gemm"])
    if "runs" in results.get("throughput", {}):
        lines += _throughput_md(results["throughput"])
    if "problems" in results.get("trainer", {}):
        lines += _trainer_md(results["trainer"])
    lines += [f"Peak memory source: {results['memory']['source']}"]
    return "\n".join(lines) + "\n"


def _btp_md(b: dict) -> list[str]:
    s = b["statistic"]
    lines = [
        f"BTP, {b['group']}, {b['layers']} blocks, {b['dtype']}, compiled ({b['backend']}):",
        "",
    ]
    if "error" in s:
        lines.append(f"- statistic: **ERROR** {s['error'][:200]}")
    else:
        lines.append(
            f"- Online-RMSNorm statistic through reduce_down, inductor: bitwise equal to "
            f"eager: {'yes' if s['bitwise_equal_eager'] else '**NO**'}; max rel diff vs "
            f"fp32 {s['max_rel_diff_vs_fp32']:.1e} (max {s['rtol']:.1e}; plain bf16 "
            f"{s['plain_bf16_max_rel_diff']:.1e})"
        )
    lines += [
        "",
        "| arch | block graphs (expected) | loss eager / compiled | loss rel diff "
        "| grad rel diff | ok |",
        "|---|---|---|---|---|---|",
    ]
    for arch, r in b["archs"].items():
        if "error" in r:
            lines.append(f"| {arch} | **ERROR** {r['error'][:200]} | | | | **NO** |")
            continue
        lines.append(
            f"| {arch} | {r['block_graphs']} ({r['block_graphs_expected']}) "
            f"| {r['eager_loss'][0]:.6f} / {r['compiled_loss'][0]:.6f} "
            f"| {r['loss_max_rel_diff']:.1e} | {r['grad_max_rel_diff']:.1e} "
            f"| {'yes' if r['ok'] else '**NO**'} |"
        )
    return lines + [""]


def _sdpa_md(t: dict) -> list[str]:
    lines = [f"SDPA kernel per architecture ({t['source']}):", ""]
    for arch, r in t["archs"].items():
        if "error" in r:
            lines.append(f"- {arch}: **ERROR** {r['error'][:200]}")
        else:
            lines.append(f"- {arch}: " + ", ".join(f"{d} {x['kernel']}" for d, x in r.items()))
    return lines + [""]


def _trainer_md(t: dict) -> list[str]:
    lines = [f"Trainer: `{t['command']}` ({t['seconds']:.0f} s, exit {t['returncode']}):", ""]
    if t["losses"]:
        last = max(t["losses"], key=int)
        lines.append(
            f"- {len(t['losses'])} steps, last loss {t['losses'][last]:.4f}, memory "
            f"{t['memory_gib'][last]:.2f} GiB, {t['tokens_per_s'][last]:.0f} tokens/s, "
            f"MFU {t['mfu_pct'][last]:.1f}%; step guard skipped step "
            f"{t['guard_skipped_step']}; profiled steps (ms): {t['profiled_step_ms']}"
        )
    lines += [f"- **problem**: {p[:300]}" for p in t["problems"]]
    return lines + [""]


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
