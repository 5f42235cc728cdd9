"""What a conversion shows: a progress bar with a time estimate (stderr) and the error
tables (stdout), from :attr:`boost_titan.checkpoint.from_dense.convert.Converter.report`."""

from __future__ import annotations

import sys
import time
from typing import IO, Any

from boost_titan.models.model import PROJ_ORDER


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """``[#####-----]  12/168 projections (block 1/24, wk)  0m41s, ~8m10s left`` on
    stderr: redrawn in place on a terminal, one line per block otherwise."""

    def __init__(self, total: int, blocks: int, stream: IO[str] | None = None, enabled=True):
        self.total, self.blocks, self.done = total, blocks, 0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and self.stream.isatty()
        self.start = time.monotonic()

    def line(self, block: int, name: str) -> str:
        elapsed = time.monotonic() - self.start
        left = elapsed / self.done * (self.total - self.done) if self.done else 0.0
        width = 24
        filled = width * self.done // max(self.total, 1)
        bar = "#" * filled + "-" * (width - filled)
        return (
            f"from-dense [{bar}] {self.done}/{self.total} projections "
            f"(block {block + 1}/{self.blocks}, {name})  {_duration(elapsed)}, "
            f"~{_duration(left)} left"
        )

    def advance(self, block: int, name: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r" + self.line(block, name) + "\x1b[K")
        elif name == PROJ_ORDER[-1]:
            self.stream.write(self.line(block, name) + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self.done and self.enabled:
            self.stream.write("\n")
            self.stream.flush()
        self.enabled = self.tty = False


def _table(title: str, layers: list[dict], cell) -> list[str]:
    head = f"{'block':>5} " + " ".join(f"{n:>11}" for n in PROJ_ORDER)
    lines = [title, head]
    sums = {n: [] for n in PROJ_ORDER}
    for layer in layers:
        cells = []
        for n in PROJ_ORDER:
            text, value = cell(layer["projections"][n])
            cells.append(f"{text:>11}")
            if value is not None:
                sums[n].append(value)
        lines.append(f"{layer['layer']:>5} " + " ".join(cells))
    means = [f"{sum(v) / len(v):>11.4f}" if v else f"{'':>11}" for v in sums.values()]
    lines.append(f"{'mean':>5} " + " ".join(means))
    return lines


def tables(report: dict[str, Any]) -> str:
    """The per-block error tables of a conversion report."""
    layers = report["layers"]
    ranks = layers[0]["projections"] if layers else {}
    rank_note = ", ".join(f"{n} {ranks[n]['rank']}" for n in PROJ_ORDER if n in ranks)
    lines = _table(
        f"relative Frobenius error ||W - B A|| / ||W|| of the SVD factors (ranks: {rank_note})",
        layers,
        lambda p: (f"{p['svd_rel_err']:.4f}", p["svd_rel_err"]),
    )
    if report.get("calibration_tokens"):
        fitted = "act_fitted" in layers[0]["projections"]["wq"]
        held = report.get("heldout_tokens", 0)

        def act(p, key_plain, key_fit):
            if fitted:
                return f"{p[key_plain]:.3f}>{p[key_fit]:.3f}", p[key_fit]
            return f"{p[key_plain]:.4f}", p[key_plain]

        what = "plain SVD > fitted" if fitted else "plain SVD"
        lines.append("")
        lines += _table(
            f"relative activation error ||W X - B act(A X)|| / ||W X|| on "
            f"{report['fit_tokens']} calibration tokens ({what})",
            layers,
            lambda p: act(p, "act_plain", "act_fitted"),
        )
        if held:
            lines.append("")
            lines += _table(
                f"the same on {held} held-out tokens ({what})",
                layers,
                lambda p: act(p, "heldout_plain", "heldout_fitted"),
            )
    return "\n".join(lines)
