"""torchft replica groups (``[fault_tolerance] enable = true``, boost_titan.train.replicas):
groups of gloo ranks, each its own launch, joined by a lighthouse in this process."""

from __future__ import annotations

import copy
import re
import threading
from pathlib import Path

import pytest
from helpers import run_training

STEPS = ("--training.steps", "3", "--validation.no-enable", "--boost.profile_freq", "0")
REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def lighthouse(monkeypatch):
    """A lighthouse in this process; the groups launched find it through the environment."""
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=2000)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", server.address())
    yield server.address()
    server.shutdown()


def run_groups(
    config: str, groups: int, per_group: int, root: Path, address: str, *extra,
    steps: int = 3, env: dict[int, dict[str, str]] | None = None,
):  # fmt: skip
    """``groups`` launches of ``per_group`` ranks each, at once, as replica groups of one
    job; returns their runs (``run_training``'s), group 0 first. ``env[i]``: variables
    for group ``i`` alone."""
    runs: list = [None] * groups
    errors: list = []

    def one(i: int) -> None:
        try:
            runs[i] = run_training(
                config,
                per_group,
                root / f"group{i}",
                *STEPS,
                "--training.steps",
                str(steps),
                "--fault_tolerance.enable",
                "--fault_tolerance.group_size",
                str(groups),
                "--fault_tolerance.replica_id",
                str(i),
                "--fault_tolerance.min_replica_size",
                str(groups),
                *extra,
                timeout=600,
                env=(env or {}).get(i),
            )
        except BaseException as e:  # (re-raised in the test's thread)
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(groups)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return runs


def test_two_groups_of_one_rank_equal_dp2_without_ft(tmp_path, lighthouse):
    dp2 = ("--parallelism.data_parallel_shard_degree", "2")
    reference = run_training("debug_cola.toml", 2, tmp_path / "dp2", *STEPS, *dp2)
    runs = run_groups("debug_cola.toml", 2, 1, tmp_path, lighthouse)
    want = reference.loss[0]
    assert sorted(want) == [1, 2, 3]
    for i, run in enumerate(runs):
        got = run.loss[0]
        assert got.keys() == want.keys(), run.output[-3000:]
        for step in want:
            assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-5), (i, step)


# ---------------------------------------------------------------- semi-synchronous
SEMI_SYNC_CASES = [
    (["--fault_tolerance.semi_sync_method", "fedavg"],
     "[fault_tolerance] semi_sync_method = 'fedavg' is not a method: 'diloco', 'local_sgd'"),
    (["--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", "0"],
     "[fault_tolerance] sync_steps = 0 must be >= 1"),
    (["--fault_tolerance.semi_sync_method", "local_sgd", "--fault_tolerance.sync_steps", "3"],
     "[training] steps = 20 with semi_sync_method = 'local_sgd' must be a multiple of "
     "[fault_tolerance] sync_steps = 3"),
    (["--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", "5"], None),
]  # fmt: skip


@pytest.mark.parametrize(
    "extra,refusal", SEMI_SYNC_CASES, ids=["unknown", "sync_steps_0", "steps_not_multiple", "ok"]
)
def test_semi_sync_parse(extra, refusal):
    """What semi-synchronous training accepts and refuses, in one line, at parse."""
    from boost_titan.train.config_check import parse_config
    from boost_titan.train.config_check.common import ConfigError

    argv = ["--job.config_file", str(REPO_ROOT / "train_configs" / "debug_cola.toml"),
            "--fault_tolerance.enable", "--fault_tolerance.group_size", "2", *extra]  # fmt: skip
    if refusal is None:
        config = parse_config(argv)
        assert (config.fault_tolerance.semi_sync_method, config.fault_tolerance.sync_steps) == (
            "diloco", 5,
        )  # fmt: skip
        return
    with pytest.raises(ConfigError) as e:
        parse_config(argv)
    assert refusal in str(e.value) and "\n" not in str(e.value)


H, OUTER_STEPS = 2, 2  # sync every 2 inner steps, 2 syncs (the second uses the momentum)
# small batches: the steps' numbers, not their cost, are what is compared
SMALL = ("--training.local_batch_size", "2", "--training.seq_len", "64")
MIB_LINE = re.compile(
    r"\[rank(\d+)\]:.*? (\w+) sync (\d+) at step (\d+): [\d.]+ MiB per group \((\d+) bytes"
)


def semi_sync_reference(
    config: str, seed_step: Path, method: str, groups: int, dp: int = 1, skipped=frozenset()
):
    """DiLoCo / local SGD written here, in one process: each group's model trains H
    steps on its own batches (data-parallel ranks ``i * dp ...`` of ``groups * dp``,
    concatenated: a group of ``dp`` FSDP ranks) with its own AdamW,
    LR schedule and clipping (a (group, step) in ``skipped``: no optimizer or LR step, as
    the NaN guard's skip), then the groups meet: DiLoCo takes one Nesterov SGD step
    (lr 0.7, momentum 0.9) from the last global parameters along the averaged
    pseudo-gradient (global - local); local SGD averages the parameters. Returns
    (losses[group][step], final parameters, the model's parameter bytes)."""
    import torch
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F
    from torchtitan.components.lr_scheduler import build_lr_schedulers
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.protocols.train_spec import get_train_spec

    from boost_titan.data.loader import build_dataloader
    from boost_titan.train.config_check import parse_config
    from boost_titan.train.specs import register_all

    register_all()
    steps = H * OUTER_STEPS
    cfg = parse_config(
        ["--job.config_file", str(REPO_ROOT / "train_configs" / config),
         "--training.steps", str(steps), *SMALL]
    )  # fmt: skip
    spec = get_train_spec(cfg.model.name)
    args = copy.deepcopy(spec.model_args[cfg.model.flavor])
    args.update_from_config(cfg)
    tokenizer = spec.build_tokenizer_fn(cfg)
    start = spec.model_cls(args)
    state = start.state_dict()
    dcp.load(state, checkpoint_id=str(seed_step), no_dist=True)
    start.load_state_dict(state)
    o = cfg.optimizer
    kwargs = dict(
        lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
        fused=o.implementation == "fused", foreach=o.implementation == "foreach",
    )  # fmt: skip
    models = [copy.deepcopy(start) for _ in range(groups)]
    optims = [OptimizersContainer([m], torch.optim.AdamW, kwargs) for m in models]
    scheds = [build_lr_schedulers(opt, cfg.lr_scheduler, steps) for opt in optims]
    readers = [
        [iter(build_dataloader(groups * dp, i * dp + r, tokenizer, cfg)) for r in range(dp)]
        for i in range(groups)
    ]
    global_params = [p.detach().clone() for p in start.parameters()]
    momentum = [torch.zeros_like(p) for p in global_params]
    losses = [{} for _ in range(groups)]
    for step in range(1, steps + 1):
        for i, model in enumerate(models):
            batch = [next(reader) for reader in readers[i]]
            inputs = torch.cat([x["input"] for x, _ in batch])
            labels = torch.cat([y for _, y in batch])
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.max_norm)
            if (i, step) not in skipped:
                optims[i].step()
                scheds[i].step()
            optims[i].zero_grad()
            losses[i][step] = loss.item()
        if step % H:
            continue
        with torch.no_grad():
            locals_ = [list(m.parameters()) for m in models]
            for k, g in enumerate(global_params):
                if method == "diloco":
                    delta = sum(g - ps[k] for ps in locals_) / groups
                    momentum[k].mul_(0.9).add_(delta)
                    g.sub_(0.7 * (delta + 0.9 * momentum[k]))
                else:
                    g.copy_(sum(ps[k] for ps in locals_) / groups)
                for ps in locals_:
                    ps[k].copy_(g)
    names = [n for n, _ in start.named_parameters()]
    nbytes = sum(p.numel() * p.element_size() for p in start.parameters())
    return losses, dict(zip(names, global_params)), nbytes


@pytest.mark.parametrize(
    "config,method,per_group,model_config,skipped",
    [
        ("debug_cola.toml", "diloco", 1, "debug_cola.toml", {(0, 1)}),
        ("debug_llama2_fsdp2.toml", "local_sgd", 2, "debug_llama2.toml", set()),
    ],
)
def test_semi_sync_equals_written_out(
    config, method, per_group, model_config, skipped, tmp_path, lighthouse, seed_checkpoint
):
    """2 groups (of 1 rank; of 2 FSDP ranks), 2 syncs of H = 2 inner steps, from a seed
    checkpoint: every group's losses and the final parameters (group 0's last
    checkpoint) equal the reference's; each sync logs the model's parameter bytes per
    group (CoLA and its dense twin; FSDP's shards summed over the group). In the DiLoCo
    case group 0 alone skips step 1 (an injected inf gradient, ``nan_policy = "skip"``):
    it still syncs with group 1 at steps 2 and 4 (syncs count the job's steps)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from boost_titan.train.fault import INJECT_ENV

    seed = seed_checkpoint(model_config)
    env = {i: {INJECT_ENV: f"inf_grad@{step}"} for i, step in skipped}
    runs = run_groups(
        config, 2, per_group, tmp_path, lighthouse, "--boost.nan_policy", "skip",
        "--fault_tolerance.semi_sync_method", method,
        "--fault_tolerance.sync_steps", str(H),
        "--checkpoint.enable", "--checkpoint.initial_load_path", str(seed),
        "--checkpoint.interval", "1000", "--checkpoint.last_save_model_only", *SMALL,
        steps=H * OUTER_STEPS, env=env,
    )  # fmt: skip
    for i, step in skipped:
        assert f"step {step}: non-finite loss or gradients; update skipped" in runs[i].output
    losses, final, nbytes = semi_sync_reference(
        model_config, seed, method, 2, per_group, frozenset(skipped)
    )
    for i, run in enumerate(runs):
        assert sorted(run.loss) == list(range(per_group)), run.output[-3000:]
        for got in run.loss.values():
            assert sorted(got) == list(range(1, H * OUTER_STEPS + 1)), run.output[-3000:]
            for step, want in losses[i].items():
                assert got[step] == pytest.approx(want, rel=1e-5, abs=1e-5), (i, step)
        # every rank logs each sync: (rank, method, sync, step, bytes per group)
        syncs = sorted(
            (int(m[1]), m[2], int(m[3]), int(m[4]), int(m[5]))
            for m in MIB_LINE.finditer(run.output)
        )
        outer = range(1, OUTER_STEPS + 1)
        assert syncs == [(r, method, k, k * H, nbytes) for r in range(per_group) for k in outer]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = runs[0].tb_event_files()
    acc = EventAccumulator(events, size_guidance={"scalars": 0})
    acc.Reload()
    tb = [(e.step, e.value) for e in acc.Scalars("ft/outer_sync_mib")]
    assert tb == [(k * H, pytest.approx(nbytes / 2**20)) for k in range(1, OUTER_STEPS + 1)]
    saved = {k: torch.zeros_like(v) for k, v in final.items()}
    last = runs[0].dump_folder / "checkpoint" / f"step-{H * OUTER_STEPS}"
    dcp.load(saved, checkpoint_id=str(last), no_dist=True)
    for name, want in final.items():
        torch.testing.assert_close(saved[name], want, rtol=1e-5, atol=1e-5, msg=name)
