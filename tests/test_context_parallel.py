"""Context parallelism (``[parallelism] context_parallel_degree``): the sequence split
over ranks, ring attention on every block, exact against one process.

Gradient by gradient (``cp_check.py``: fp32, 3 AdamW steps from the same weights, every
parameter's gradient within 1e-5 of the single process's, relative to its largest
entry) for each architecture under CP2 x FSDP2, CoLA under CP2 x BTP TP2 (with and
without sequence-parallel latents, with latent checkpointing) and compiled. The
trainer's own runs (CP2 x BTP TP2 with SP, CP2 x PP2, CP2 x FSDP2 against the
single-process run's losses and gradient norms) are in ``test_composition.py``.
"""

from __future__ import annotations

import pytest
from cp_check import run_cases

GRAD_RTOL = 1e-5  # measured: <= 2.3e-6 (LaX's gate), losses <= 1.5e-7
LOSS_RTOL = 1e-5

CASES = [
    # CP2 x FSDP2: each architecture (FSDP2's shards and reductions span dp x cp)
    {"arch": "cola", "cp": 2, "tp": 1, "dp": 2, "plan": "auto"},
    {"arch": "lax", "cp": 2, "tp": 1, "dp": 2, "plan": "auto"},
    {"arch": "svd", "cp": 2, "tp": 1, "dp": 2, "plan": "auto"},
    {"arch": "dense", "cp": 2, "tp": 1, "dp": 2, "plan": "auto"},
    # CP2 x BTP TP2: the ring inside BTP's chunks, latents sharded on d (and on the
    # sequence with SP), latent checkpointing recomputing the ring's chunk
    {"arch": "cola", "cp": 2, "tp": 2, "dp": 1, "plan": "btp"},
    {"arch": "cola", "cp": 2, "tp": 2, "dp": 1, "plan": "btp", "sp": True,
     "latent_checkpoint": "both"},  # fmt: skip
    # compiled blocks (aot_eager: the ring enters Dynamo as DTensor code), 12 blocks:
    # one graph for all of them or the recompile limit (8) fails here
    {"arch": "cola", "cp": 2, "tp": 1, "dp": 2, "plan": "auto", "compile": True, "layers": 12},
]


@pytest.mark.slow
def test_cp2_equals_one_process_gradient_by_gradient(tmp_path):
    rows = run_cases(CASES, 4, str(tmp_path))
    assert len(rows) == len(CASES)
    for row in rows:
        print({k: row[k] for k in ("arch", "cp", "tp", "dp", "plan", "loss_err", "grad_err", "worst")})
        assert row["loss_err"] <= LOSS_RTOL, row
        assert row["grad_err"] <= GRAD_RTOL, row
        assert row["cp_loss"][-1] != row["cp_loss"][0]  # the steps moved the weights
        assert row["compiled_blocks"] == (row.get("layers", 2) if row.get("compile") else 0)
