"""The NaN guard's cost and decisions in one process (boost_titan.train.fault.StepGuard):
a step waits for the device once, not once per micro-batch, judges the gradients by the
norm torchtitan's clipping computes (one norm pass per step, not two), and still skips
or stops on a NaN in any one micro-batch. The same decisions across real ranks:
tests/test_fault_tolerance.py."""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torchtitan.distributed import utils as titan_dist_utils

from boost_titan.train import fault

MICROBATCHES = 4
CLIP = fault.reporting_grad_norm(titan_dist_utils.clip_grad_norm_)


class _HostReads(TorchDispatchMode):
    """Counts the ops run inside, by name: ``_local_scalar_dense`` is every ``.item()``,
    ``bool()``, ``float()`` of a tensor, the reads that wait for the device."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def tolist_calls(monkeypatch):
    """``Tensor.tolist`` calls (a host read no dispatch mode sees), counted."""
    calls = []
    original = torch.Tensor.tolist

    def counted(self):
        calls.append(self)
        return original(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    return calls


def _trainer(policy: str, max_skips: int = 3):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = SimpleNamespace(
        optimizers=SimpleNamespace(step=opt.step, zero_grad=opt.zero_grad),
        lr_schedulers=SimpleNamespace(step=lambda: None),
        model_parts=[model],
        device="cpu",
        step=1,
        checkpointer=SimpleNamespace(enable=False),
    )
    return trainer, model, fault.StepGuard(trainer, policy, max_skips, None)


def _microbatches(trainer, model, guard, nan_in=None, inf_grad=False):
    """torchtitan's accumulation loop: backward then record_loss, per micro-batch."""
    for mb in range(MICROBATCHES):
        x = torch.full((2, 4), float(mb + 1))
        scale = float("nan") if mb == nan_in else 1.0
        loss = model(x).sum() * scale / MICROBATCHES
        loss.backward()
        if inf_grad and mb == MICROBATCHES - 1:
            with torch.no_grad():
                model.weight.grad[0, 0] = float("inf")
        guard.record_loss(loss)


def _step(trainer, model, guard, report_norm=True, **inject):
    """One train step as torchtitan runs it; the step's host reads and norm passes."""
    with _HostReads() as reads:
        with fault.grad_norms_to(guard) if report_norm else contextlib.nullcontext():
            trainer.optimizers.zero_grad()
            _microbatches(trainer, model, guard, **inject)
            per_microbatch = reads.ops["_local_scalar_dense"]
            params = list(model.parameters())
            CLIP(params, max_norm=1e9, foreach=True)
            trainer.optimizers.step()
            trainer.lr_schedulers.step()
    trainer.step += 1
    return per_microbatch, reads.ops


def test_one_host_read_and_one_norm_pass_per_step(tolist_calls):
    trainer, model, guard = _trainer("stop")
    before = model.weight.detach().clone()
    per_microbatch, ops = _step(trainer, model, guard)
    assert per_microbatch == 0  # four micro-batches, no wait for the device
    assert ops["_local_scalar_dense"] == 0 and len(tolist_calls) == 1  # the step's decision
    assert ops["_foreach_norm"] == 1  # torchtitan's, reused by the guard
    # the update is applied: SGD on the summed gradients of x = 1..4 (grad of
    # sum(W x + b) / 4 is x summed over the batch, / 4; the batch has 2 rows)
    expected_grad = torch.full((3, 4), 2 * (1 + 2 + 3 + 4) / MICROBATCHES)
    assert torch.allclose(model.weight, before - 0.1 * expected_grad)


def test_a_step_without_torchtitans_norm_computes_one(tolist_calls):
    """Clipping outside the train step's scope does not reach the guard (no norm of
    something else judges the step): the guard takes one norm pass of its own."""
    trainer, model, guard = _trainer("stop")
    _, ops = _step(trainer, model, guard, report_norm=False)
    assert ops["_foreach_norm"] == 2 and len(tolist_calls) == 1
    assert guard._grad_norm is None


@pytest.mark.parametrize("report_norm", [True, False])
def test_nan_in_one_microbatch_skips_then_stops_at_the_limit(report_norm, caplog):
    trainer, model, guard = _trainer("skip", max_skips=1)
    _step(trainer, model, guard, report_norm)  # a clean step
    weights = model.weight.detach().clone()
    with caplog.at_level(logging.WARNING):
        _step(trainer, model, guard, report_norm, nan_in=2)
    assert "step 2: non-finite loss or gradients; update skipped (1 in a row, limit 1" in (
        caplog.text
    )
    assert torch.equal(model.weight, weights)  # nothing applied
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    with pytest.raises(fault.NonFiniteStepError, match=r"^step 3: .*\(2 non-finite steps in a row"):
        _step(trainer, model, guard, report_norm, nan_in=0)
    assert torch.equal(model.weight, weights)
    assert guard.skipped_steps == [2, 3]


def test_inf_gradient_with_finite_loss_stops():
    """Judged by the clipped step's norm alone: the losses are finite."""
    trainer, model, guard = _trainer("stop")
    weights = model.weight.detach().clone()
    with pytest.raises(fault.NonFiniteStepError, match=r"^step 1: non-finite loss or gradients"):
        _step(trainer, model, guard, inf_grad=True)
    assert torch.equal(model.weight, weights)


def test_inf_loss_with_finite_gradients_is_caught():
    """A loss can be inf where its gradients are not (a constant inf added to it): the
    loss flag, not the norm, catches it."""
    trainer, model, guard = _trainer("skip")
    weights = model.weight.detach().clone()
    for mb in range(MICROBATCHES):
        loss = model(torch.ones(2, 4)).sum()
        loss.backward()
        guard.record_loss(loss + (float("inf") if mb == 1 else 0.0))
    with fault.grad_norms_to(guard):
        norm = CLIP(list(model.parameters()), max_norm=1e9, foreach=True)
        assert torch.isfinite(norm)
        trainer.optimizers.step()
    assert guard.skipped_steps == [1] and torch.equal(model.weight, weights)


def test_reporting_grad_norm_wraps_once_and_returns_the_norm():
    assert fault.reporting_grad_norm(CLIP) is CLIP
    w = torch.nn.Parameter(torch.zeros(2))
    w.grad = torch.tensor([3.0, 4.0])
    receiver = SimpleNamespace(record_grad_norm=lambda n: seen.append(float(n)))
    seen: list[float] = []
    with fault.grad_norms_to(receiver):
        assert float(CLIP([w], max_norm=1e9, foreach=True)) == 5.0
    CLIP([w], max_norm=1e9, foreach=True)  # outside: to nobody
    assert seen == [5.0]
