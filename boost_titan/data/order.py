"""The order of the training data: which tokens global sample ``i`` is, as arithmetic (no
index arrays, no processes, nothing that grows with the corpus or the cluster).

**Windows.** A tokenized corpus (``boost_titan.data.tokenized``) is one token stream:
its documents (BOS + tokens + EOS each) back to back, in corpus order. Window ``w`` of a
corpus is tokens ``[w W, (w + 1) W)`` of that stream, ``W = seq_len + 1`` (the first
``seq_len`` are the input, the last ``seq_len`` the labels): torchtitan's packing, so a
window may hold the end of one document and the start of the next. A corpus of ``T``
tokens has ``N = T // W`` windows; the last ``T - N W`` tokens are not trained on.

**Blend.** Corpora with weights ``w_k`` are blended by windows (every window is ``W``
tokens, so the token shares are the window shares): the weights are made exact
fractions ``p_k / P`` (:class:`Blend`; decimal weights stay exact up to a period of
:data:`MAX_PERIOD` samples), and slot ``q`` of every period of ``P`` samples goes to the
corpus the greedy rule of Megatron's ``BlendedDataset`` picks (the one furthest below
its share). Sample ``i`` is then window ``j = (i // P) p_k + (count of k in slots before
i % P)`` of corpus ``k``: every prefix of the sample stream holds each corpus within
one period's rounding of its weight.

**Shuffle.** Sample ``j`` of corpus ``k`` is in pass ``e = j // N`` over it, at place
``m = j % N``; with ``shuffle`` it reads window ``perm(m)`` where ``perm`` is a keyed
pseudo-random permutation of ``0..N-1`` (:func:`permute`: a 4-round Feistel network,
cycle-walked into the range) keyed by the seed, ``k`` and ``e``: each pass visits every
window once, in a new order. Windows are shuffled, not documents: a window stays one
byte range of the ``.bin`` (one read), the permutation needs no table (a document
shuffle needs an index of every document per pass, GBs at 1 TB), and what a shuffle is
for (a batch drawn from all over the corpus, not from one source or file) holds at
window granularity. Documents stay packed in corpus order inside a window.

**Who reads what.** A run that starts at sample ``S0`` (0, or the position it resumed
from) takes global batch ``g`` = samples ``[S0 + g B, S0 + (g + 1) B)``, ``B =
local_batch_size x dp``; data-parallel rank ``r`` reads the slice ``[r L, (r + 1) L)``
of each (:func:`rank_windows`, ``L = local_batch_size``), and only those windows. The
position saved is ``S0`` plus the samples consumed: the same on every rank, resumed at
any dp degree, local batch size or worker count.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

VERSION = 2  # of the saved position's layout (1: the packed stream of older releases)
MAX_PERIOD = 100_000  # samples in one period of the blend pattern, at most
MIN_WEIGHT, MAX_WEIGHT = 1e-6, 1e6  # a blend weight's range (shares differ by 1e12 at most)
WEIGHT_CHARS = 32  # a blend weight's text, at most
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


class BlendError(ValueError):
    """Blend weights that do not parse or make no blend (one line)."""


def parse_weight(text: str, where: str) -> Fraction:
    """A blend weight: a number (``0.7``, ``3``, ``2.5e-3``, ``1/3``) of at most
    :data:`WEIGHT_CHARS` characters, between :data:`MIN_WEIGHT` and :data:`MAX_WEIGHT`:
    exact as written, bounded before it is made exact (``Fraction("1e100000000")`` would
    build a 332-million-bit integer first)."""
    text = text.strip()
    valid = f"a number of at most {WEIGHT_CHARS} characters (e.g. 0.7, 3 or 1/3)"
    try:
        if len(text) > WEIGHT_CHARS:
            raise ValueError
        # "P/Q" holds two integers of at most 32 digits: exact at once; a decimal is
        # bounded as a float first, and made exact only once in range
        approx = float(Fraction(text)) if "/" in text else float(text)
        if not math.isfinite(approx) and text.lower().lstrip("+-")[:3] in ("inf", "nan"):
            raise ValueError  # (a finite text past a float's range: outside the range)
    except (ValueError, ZeroDivisionError, OverflowError):
        raise BlendError(f"{where}: weight {text!r} is not {valid}") from None
    zero = approx == 0 and not any(c in "123456789" for c in text.lower().split("e")[0])
    if approx < 0 or zero:
        raise BlendError(f"{where}: weight {text!r} must be > 0 (drop the corpus instead)")
    if not MIN_WEIGHT <= approx <= MAX_WEIGHT:
        raise BlendError(
            f"{where}: weight {text!r} is outside {MIN_WEIGHT:g}..{MAX_WEIGHT:g}, the range "
            "of a blend weight"
        )
    return Fraction(text)


class Blend:
    """Integer parts ``p_k`` of a period of ``P`` samples, and which corpus takes each
    slot of the period (see the module)."""

    def __init__(self, weights: list[Fraction]):
        if not weights:
            raise BlendError("a blend needs at least one corpus")
        total = sum(weights)
        shares = [w / total for w in weights]
        period = math.lcm(*(s.denominator for s in shares))
        if period <= MAX_PERIOD:
            parts = [int(s * period) for s in shares]
        else:  # largest remainder over MAX_PERIOD slots, each corpus at least one
            period = MAX_PERIOD
            exact = [s * period for s in shares]
            parts = [max(1, int(e)) for e in exact]
            order = sorted(range(len(parts)), key=lambda k: (-(exact[k] - int(exact[k])), k))
            for k in order[: period - sum(parts)]:
                parts[k] += 1
            period = sum(parts)
        g = math.gcd(*parts)
        self.parts = [p // g for p in parts]
        self.period = sum(self.parts)
        self.pattern, self.before = self._slots()

    def _slots(self) -> tuple[np.ndarray, np.ndarray]:
        """Megatron's greedy assignment over one period: slot ``q`` goes to the corpus
        with the largest deficit ``p_k (q + 1) - P count_k`` (ties: the first)."""
        parts = np.asarray(self.parts, np.int64)
        counts = np.zeros(len(parts), np.int64)
        pattern = np.empty(self.period, np.int32)
        before = np.empty(self.period, np.int64)
        for q in range(self.period):
            k = int(np.argmax(parts * (q + 1) - self.period * counts))
            pattern[q], before[q] = k, counts[k]
            counts[k] += 1
        return pattern, before

    def locate(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(corpus, sample index within that corpus) of each global sample."""
        samples = np.asarray(samples, np.int64)
        periods, slot = np.divmod(samples, self.period)
        corpus = self.pattern[slot]
        return corpus, periods * np.asarray(self.parts, np.int64)[corpus] + self.before[slot]


# ---------------------------------------------------------------------------------------
# The shuffle: a keyed permutation of 0..n-1 computed per element


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer (uint64 in, uint64 out, wrapping)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def pass_key(seed: int, corpus: int, epoch: int) -> int:
    """The permutation key of one pass over one corpus of a blend."""
    words = np.asarray([seed & 0xFFFFFFFFFFFFFFFF, corpus, epoch], np.uint64)
    key = np.uint64(0x9E3779B97F4A7C15)
    for w in words:
        key = _mix(np.asarray(key ^ w, np.uint64))
    return int(key)


def permute(index: np.ndarray, n: int, key: int, rounds: int = 4) -> np.ndarray:
    """``perm(index)`` for the keyed permutation of ``0..n-1``: a balanced Feistel network
    on ``2h`` bits (the smallest ``4^h >= n``), applied again to any value that lands at
    or above ``n`` (cycle walking: still a bijection of ``0..n-1``, under 4 walks on
    average)."""
    if n < 1:
        raise ValueError(f"a permutation of {n} elements")
    h = max(1, math.ceil(math.log2(n) / 2)) if n > 1 else 1
    mask, shift = np.uint64((1 << h) - 1), np.uint64(h)
    keys = [_mix(np.asarray(key + r * 0x632BE59BD9B4E019 & 0xFFFFFFFFFFFFFFFF, np.uint64))
            for r in range(rounds)]  # fmt: skip
    x = np.array(index, dtype=np.uint64, copy=True, ndmin=1)
    todo = np.ones(x.shape, bool)
    while todo.any():
        v = x[todo]
        left, right = v >> shift, v & mask
        for k in keys:
            left, right = right, left ^ (_mix(right ^ k) & mask)
        v = (left << shift) | right
        x[todo] = v
        todo[todo] = v >= np.uint64(n)
    return x.astype(np.int64)


# ---------------------------------------------------------------------------------------
# Samples -> windows


class Order:
    """The windows every global sample reads: ``windows[k]`` windows in corpus ``k``."""

    def __init__(self, windows: list[int], blend: Blend, seed: int, shuffle: bool):
        self.windows, self.blend, self.seed, self.shuffle = list(windows), blend, seed, shuffle

    def lookup(self, samples) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(corpus, pass over it, window id in it) of each global sample."""
        corpus, j = self.blend.locate(samples)
        n = np.asarray(self.windows, np.int64)[corpus]
        epoch, place = np.divmod(j, n)
        if not self.shuffle:
            return corpus, epoch, place
        window = place.copy()
        for k, e in {(int(k), int(e)) for k, e in zip(corpus, epoch)}:
            sel = (corpus == k) & (epoch == e)
            window[sel] = permute(place[sel], self.windows[k], pass_key(self.seed, k, e))
        return corpus, epoch, window


def rank_slice(dp_rank: int, local_batch: int) -> tuple[int, int]:
    """``[start, end)`` of the samples of a global batch that ``dp_rank`` trains on."""
    return dp_rank * local_batch, (dp_rank + 1) * local_batch


def rank_windows(start: int, batch: int, dp_rank: int, local_batch: int, dp: int) -> range:
    """The global sample indices of local batch ``batch`` (0, 1, ... from the run's
    start at sample ``start``) of ``dp_rank`` out of ``dp``."""
    lo, hi = rank_slice(dp_rank, local_batch)
    first = start + batch * local_batch * dp
    return range(first + lo, first + hi)
