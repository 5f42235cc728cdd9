"""Screenshot the BOOST dashboard of a finished run, as a browser shows it.

    python -m boost_titan.tools.screenshot --logdir outputs/debug_cola_btp_tp2/tb \\
        --out docs/dashboard.png [--page custom_scalars] [--size 1400,2000]

Starts TensorBoard on a free local port over ``--logdir``, waits until it has loaded
the runs, loads ``http://localhost:PORT/#<page>`` in headless Chromium (Debian's
``chromium`` package: ``apt-get install chromium``) and saves the rendered page. The
page is TensorBoard's own front end, so the picture is what a user sees: the
custom-scalars layout the run wrote (``boost_titan.dashboard``) with its charts drawn
from the event files. Exits non-zero, naming what is missing, when Chromium or the log
dir is absent or the picture was not written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--hide-scrollbars",
    # no calls home: this machine's network is closed, and they slow every start
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_runs(url: str, timeout: float) -> list[str]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(f"{url}/data/runs", timeout=2) as r:
                runs = json.load(r)
            if runs:
                return runs
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"TensorBoard at {url} listed no runs within {timeout:.0f} s")


def screenshot(logdir: str, out: str, page: str, size: str, budget_ms: int) -> list[str]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("chromium not found: install Debian's package (apt-get install chromium)")
    if not os.path.isdir(logdir):
        raise SystemExit(f"--logdir {logdir} does not exist: train a run first (make train)")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    tb = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", logdir, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        runs = _wait_for_runs(url, timeout=60)
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        if os.path.exists(out):
            os.remove(out)
        with tempfile.TemporaryDirectory() as profile:
            subprocess.run(
                [
                    chromium,
                    *CHROMIUM_FLAGS,
                    f"--user-data-dir={profile}",
                    f"--window-size={size}",
                    f"--virtual-time-budget={budget_ms}",  # let the charts load and draw
                    f"--screenshot={os.path.abspath(out)}",
                    f"{url}/#{page}",
                ],
                check=True,
                timeout=180,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
    finally:
        tb.terminate()
        tb.wait(timeout=30)
    if not os.path.isfile(out) or os.path.getsize(out) == 0:
        raise SystemExit(f"chromium wrote no screenshot to {out}")
    return runs


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--logdir", required=True, help="a run's tb/ folder (or any log dir)")
    p.add_argument("--out", default="docs/dashboard.png")
    p.add_argument("--page", default="custom_scalars", help="TensorBoard tab, e.g. text")
    p.add_argument("--size", default="1400,2000", help="window width,height in pixels")
    p.add_argument("--budget-ms", type=int, default=20000, help="virtual time to render")
    a = p.parse_args(argv)
    runs = screenshot(a.logdir, a.out, a.page, a.size, a.budget_ms)
    print(f"wrote {a.out} ({os.path.getsize(a.out)} bytes): {a.page} of runs {runs}")


if __name__ == "__main__":
    main()
