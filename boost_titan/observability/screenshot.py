"""Screenshot the BOOST dashboard of a finished run, as a browser shows it.

    boost-titan screenshot --logdir outputs/debug_cola_btp_tp2/tb \\
        --out docs/dashboard.png [--page custom_scalars] [--width 1400]

Starts TensorBoard on a free local port over ``--logdir``, waits until it has loaded
the runs, loads ``http://localhost:PORT/#<page>`` in headless Chromium (Debian's
``chromium`` package: ``apt-get install chromium``), driven over its DevTools pipe
(``--remote-debugging-pipe``: no network port, no extra package), and saves the rendered
page. The page is TensorBoard's own front end, so the picture is what a user sees: the
custom-scalars layout the run wrote (``boost_titan.observability.dashboard``) with its charts drawn
from the event files. Before the capture it opens every chart's "Matches" list, the
legend of TensorBoard's multi-line charts (each series' marker and tag), and grows the
window to the page's full height, so no section is cut. Exits non-zero, naming what is
missing, when Chromium or the log dir is absent or the picture was not written.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from boost_titan.config import Parser, refusal

PROG = "boost-titan screenshot"

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


# Run in the page. ``deep``: every element of the document and of its shadow roots
# (TensorBoard's Polymer components keep their DOM in shadow roots, out of reach of
# querySelectorAll); each script is a function of its own (the page keeps its globals).
_DEEP = """
  const deep = (root, out = []) => {
    for (const el of root.querySelectorAll('*')) {
      out.push(el);
      if (el.shadowRoot) deep(el.shadowRoot, out);
    }
    return out;
  };
"""
# open each multi-line chart's "Matches" list (its legend); returns how many were opened
_OPEN_LEGENDS = (
    "(() => {"
    + _DEEP
    + """
  const buttons = deep(document).filter(e => e.classList.contains('toggle-matches-button'));
  buttons.forEach(b => b.click());
  return buttons.length;
})()"""
)
# how many pixels the tallest scrolled pane hides (the page scrolls inside TensorBoard's
# dashboard pane, not the document)
_HIDDEN_PX = (
    "(() => {"
    + _DEEP
    + """
  return Math.max(0, ...deep(document).map(e => e.scrollHeight - e.clientHeight));
})()"""
)


class _DevTools:
    """Chromium's DevTools protocol over ``--remote-debugging-pipe``: JSON messages, each
    ended by a NUL byte, written to the browser's fd 3 and read from its fd 4."""

    def __init__(self, chromium: str, flags: list[str]) -> None:
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def fds() -> None:  # in the child: the pipe ends at the fds Chromium expects
            os.dup2(to_browser_r, 3)
            os.dup2(from_browser_w, 4)

        self.proc = subprocess.Popen(
            [chromium, *flags, "--remote-debugging-pipe", "about:blank"],
            preexec_fn=fds,
            # 3 and 4 too: the fds not kept are closed after preexec_fn has run
            pass_fds=(3, 4, to_browser_r, from_browser_w),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buf = b""
        self._id = 0
        self.session: str | None = None

    def call(self, method: str, timeout: float = 60, **params) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if self.session is not None and not method.startswith("Target."):
            msg["sessionId"] = self.session
        os.write(self._to_browser, json.dumps(msg).encode() + b"\0")
        end = time.monotonic() + timeout
        while True:
            while b"\0" not in self._buf:
                if time.monotonic() > end:
                    raise RuntimeError(f"chromium did not answer {method} in {timeout:.0f} s")
                chunk = os.read(self._from_browser, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"chromium exited during {method}")
                self._buf += chunk
            raw, self._buf = self._buf.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._id:  # events and other replies are skipped
                if "error" in reply:
                    raise RuntimeError(f"chromium refused {method}: {reply['error']}")
                return reply.get("result", {})

    def evaluate(self, expression: str):
        reply = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in reply:
            raise RuntimeError(f"script failed in the page: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=10)
        except RuntimeError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)


def _capture(chromium: str, url: str, out: str, width: int, settle_s: float) -> None:
    height = 1200
    with tempfile.TemporaryDirectory() as profile:
        tools = _DevTools(chromium, [*CHROMIUM_FLAGS, f"--user-data-dir={profile}"])
        try:
            target = tools.call("Target.createTarget", url="about:blank")["targetId"]
            tools.session = tools.call("Target.attachToTarget", targetId=target, flatten=True)[
                "sessionId"
            ]
            metrics = dict(width=width, deviceScaleFactor=1, mobile=False)
            tools.call("Emulation.setDeviceMetricsOverride", height=height, **metrics)
            tools.call("Page.navigate", url=url)
            time.sleep(settle_s)  # TensorBoard fetches the layout, then every chart's data
            opened = tools.evaluate(_OPEN_LEGENDS)
            if not opened:
                raise SystemExit(
                    refusal(PROG, f"no chart with a legend on {url}: is it a custom-scalars page?")
                )
            time.sleep(2)
            height += int(tools.evaluate(_HIDDEN_PX)) + 40
            tools.call("Emulation.setDeviceMetricsOverride", height=height, **metrics)
            time.sleep(settle_s / 2)  # charts that came into view draw
            png = tools.call("Page.captureScreenshot", format="png")["data"]
        finally:
            tools.close()
    with open(out, "wb") as f:
        f.write(base64.b64decode(png))


def screenshot(logdir: str, out: str, page: str, width: int, settle_s: float) -> list[str]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit(
            refusal(PROG, "chromium not found: install Debian's package (apt-get install chromium)")
        )
    if not os.path.isdir(logdir):
        raise SystemExit(
            refusal(PROG, f"--logdir {logdir} does not exist: train a run first (make train)")
        )
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
        _capture(chromium, f"{url}/#{page}", os.path.abspath(out), width, settle_s)
    finally:
        tb.terminate()
        tb.wait(timeout=30)
    if not os.path.isfile(out) or os.path.getsize(out) == 0:
        raise SystemExit(refusal(PROG, f"chromium wrote no screenshot to {out}"))
    return runs


def main(argv: list[str] | None = None) -> None:
    p = Parser(
        prog=PROG,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--logdir", required=True, help="a run's tb/ folder (or any log dir)")
    p.add_argument(
        "--out", default="docs/dashboard.png", help="the PNG to write (default %(default)s)"
    )
    p.add_argument("--page", default="custom_scalars", help="TensorBoard tab, e.g. text")
    p.add_argument("--width", type=int, default=1400, help="window width in pixels")
    p.add_argument("--settle", type=float, default=10.0, help="seconds to let the charts draw")
    a = p.parse_args(argv)
    runs = screenshot(a.logdir, a.out, a.page, a.width, a.settle)
    print(f"wrote {a.out} ({os.path.getsize(a.out)} bytes): {a.page} of runs {runs}")
