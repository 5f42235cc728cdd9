"""LORO: the single-device step against the published update written out here, and the
distributed step (simulated TP4, both plans) against the single-device step.

Real gloo ranks (TP2, TP2 x FSDP2, PP2) and training runs are in test_loro_ranks.py."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from boost_titan.parallel import cpu_runtime

cpu_runtime.activate()

import torch  # noqa: E402
from torch.distributed._local_tensor import LocalTensorMode  # noqa: E402
from torch.distributed.tensor import DTensor, distribute_tensor  # noqa: E402
from tp_sim import fake_world, plain, plan_fn, reference_model, small_args  # noqa: E402

from boost_titan.models.bottleneck import Bottleneck  # noqa: E402
from boost_titan.models.flavors import MODEL_ARCH, flavors_for  # noqa: E402
from boost_titan.optim.loro import LORO  # noqa: E402

HP = dict(lr=0.01, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, lr_scaler=-1.0)
HP.update(refresh="all", restart_warmup=5)


def svd_args(**overrides):
    return small_args(flavors_for(MODEL_ARCH["svd_llama2"])["debugmodel"], **overrides)


def published_step(B, A, gB, gA, lr, betas, eps, exact, scaler):
    """One LORO step from fresh Adam states on W = B A, from the paper's formulas: Adam
    directions of the factors; lazy: scaled factor steps; exact: the best rank-r
    approximation (full SVD of the d_out x d_in matrix) of W minus the projection of the
    implied gradient onto the tangent space at W. Returns the new W, in float64."""
    b1, b2 = betas
    step = lr * (1 - b2) ** 0.5 / (1 - b1)
    direction = lambda g: ((1 - b1) * g) / (((1 - b2) * g * g).sqrt() + eps)  # noqa: E731
    dB, dA = direction(gB).double(), direction(gA).double()
    B, A = B.double(), A.double()
    if not exact:
        return (B - step * scaler * dB) @ (A - step * scaler * dA)
    M, N = B, A.T
    U, Rm = torch.linalg.qr(M)
    V, Rn = torch.linalg.qr(N)
    GV = dB @ torch.linalg.inv(Rn)  # G V, from dB = G N
    UtG = torch.linalg.inv(Rm).T @ dA  # U^T G, from dA^T = G^T M
    I_out, I_in = torch.eye(M.shape[0], dtype=M.dtype), torch.eye(N.shape[0], dtype=M.dtype)
    tangent = U @ UtG @ (I_in - V @ V.T) + (I_out - U @ U.T) @ GV @ V.T + U @ UtG @ V @ V.T
    u, s, vh = torch.linalg.svd(M @ N.T - step * tangent)
    r = M.shape[1]
    return u[:, :r] @ torch.diag(s[:r]) @ vh[:r]


def _grads(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g) * 1e-2 for n, p in model.named_parameters()}


def _single_step(model, grads, exact: bool, steps: int = 1, **kw):
    model = copy.deepcopy(model)
    kw = {**HP, **kw}
    opt = LORO(model, model_dim=model.model_args.dim, exact_every=1 if exact else 10**6, **kw)
    for _ in range(steps):
        for n, p in model.named_parameters():
            p.grad = grads[n].clone()
        opt.step()
    return model, opt


@pytest.mark.parametrize("exact", [False, True], ids=["lazy", "exact"])
def test_single_device_step_equals_published_update(exact):
    args = svd_args()
    ref = reference_model(args)
    grads = _grads(ref)
    model, _ = _single_step(ref, grads, exact)
    d = args.dim
    for name in ("layers.0.attention.wq", "layers.1.feed_forward.w2", "layers.0.attention.wk"):
        old = ref.get_submodule(name)
        new = model.get_submodule(name)
        B, A = old.up.weight.detach(), old.down.weight.detach()
        want = published_step(
            B,
            A,
            grads[f"{name}.up.weight"],
            grads[f"{name}.down.weight"],
            HP["lr"],
            HP["betas"],
            HP["eps"],
            exact,
            old.rank / d,
        )
        got = (new.up.weight @ new.down.weight).detach().double()
        rel = ((got - want).abs().max() / want.abs().max()).item()
        assert rel < 1e-5, (name, rel)
        assert (got - (B @ A).double()).abs().max() > 1e-4  # it moved
        if exact:  # balanced factors: B^T B = A A^T = the kept singular values
            Bt_B = (new.up.weight.T @ new.up.weight).detach()
            A_At = (new.down.weight @ new.down.weight.T).detach()
            scale = Bt_B.diagonal().max().item()
            assert (Bt_B - A_At).abs().max() < 1e-5 * scale
            assert (Bt_B - torch.diag(Bt_B.diagonal())).abs().max() < 1e-5 * scale
    # everything else is the reference's AdamW: p -= lr * direction * sqrt(1-b2) / (1-b1)
    b1, b2 = HP["betas"]
    g = grads["norm.weight"]
    want = ref.norm.weight - HP["lr"] * (1 - b2) ** 0.5 / (1 - b1) * (
        (1 - b1) * g / (((1 - b2) * g * g).sqrt() + HP["eps"])
    )
    torch.testing.assert_close(model.norm.weight, want, rtol=1e-6, atol=1e-7)


def test_exact_step_schedule_refresh_and_restart():
    """K = 3: steps 3 and 6 are exact, the states are zeroed after them and the lr
    multiplier restarts at ~0 on step 4 and ramps over restart_warmup steps."""
    model = reference_model(svd_args())
    opt = LORO(model, model_dim=model.model_args.dim, **{**HP, "restart_warmup": 2}, exact_every=3)
    assert [opt.is_exact(t) for t in range(1, 8)] == [0, 0, 1, 0, 0, 1, 0]
    assert [opt.restart_factor(t) for t in range(1, 8)] == [1, 1, 1, 1e-6, 0.5, 1, 1e-6]
    grads = _grads(model)
    for _ in range(3):
        for n, p in model.named_parameters():
            p.grad = grads[n].clone()
        opt.step()
    p = model.layers["0"].attention.wq.up.weight
    assert opt.loro_step == 3 and opt.state[p]["step"] == 0
    assert opt.state[p]["exp_avg"].abs().max() == 0


def test_loro_refuses_activation_inside():
    for arch in ("cola_llama2", "lax_llama2"):
        model = reference_model(small_args(flavors_for(MODEL_ARCH[arch])["debugmodel"]))
        with pytest.raises(ValueError, match="LORO needs W = B A"):
            LORO(model, model_dim=128, exact_every=1, **HP)


def _simulated_step(ref, grads, plan: str, tp: int, exact: bool):
    model = copy.deepcopy(ref)
    with fake_world(tp) as mesh, LocalTensorMode(tp):
        plan_fn(plan)(model, mesh)
        for n, p in model.named_parameters():
            p.grad = (
                distribute_tensor(grads[n], p.device_mesh, p.placements)
                if isinstance(p, DTensor)
                else grads[n].clone()
            )
        opt = LORO(model, model_dim=ref.model_args.dim, exact_every=1 if exact else 10**6, **HP)
        opt.step()
        return {n: plain(p.detach()) for n, p in model.named_parameters()}


@pytest.mark.parametrize("exact", [False, True], ids=["lazy", "exact"])
@pytest.mark.parametrize("plan", ["btp", "vanilla"])
def test_simulated_tp4_step_equals_single_device(plan, exact):
    """BTP splits both factors by rows (TSQR, r x r all-reduces); vanilla splits r (the
    factors are gathered for the exact step). Factors, not only W, must match. The core
    SVDs are spread over the 4 ranks (14 pairs: batches 4, 4, 4, 2); that this is bitwise
    the replicated step is checked on real ranks (test_loro_ranks.py)."""
    ref = reference_model(svd_args())
    grads = _grads(ref)
    want, _ = _single_step(ref, grads, exact)
    got = _simulated_step(ref, grads, plan, 4, exact)
    for n, p in want.named_parameters():
        rel = ((got[n] - p).abs().max() / p.abs().max()).item()
        assert rel < 1e-5, (n, rel)


def test_exact_float32_matches_float64():
    """exact_dtype "float32" (the reference's) against the default float64 on one device,
    per factor pair: W = B A agrees to ~1e-6 relative (measured 1.3e-6), the factors to
    ~1e-5 (singular vectors are more sensitive: measured 4e-5). An unknown dtype is
    refused by name."""
    ref = reference_model(svd_args())
    grads = _grads(ref)
    want, _ = _single_step(ref, grads, True)
    got, _ = _single_step(ref, grads, True, exact_dtype="float32")
    rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()  # noqa: E731
    w_err, f_err = [], []
    for name, mod in want.named_modules():
        if not isinstance(mod, Bottleneck):
            continue
        other = got.get_submodule(name)
        W = mod.up.weight.double() @ mod.down.weight.double()
        w_err.append(rel(other.up.weight.double() @ other.down.weight.double(), W))
        f_err += [rel(other.up.weight, mod.up.weight), rel(other.down.weight, mod.down.weight)]
    print(f"\nfloat32 vs float64 exact step: W {max(w_err):.1e}, factors {max(f_err):.1e}")
    assert len(w_err) == 14 and 0 < max(w_err) < 3e-6 and max(f_err) < 1e-4
    with pytest.raises(ValueError, match=r"exact_dtype 'bfloat16' is not valid; choose one of"):
        LORO(ref, model_dim=128, exact_every=1, exact_dtype="bfloat16", **HP)


def test_exact_dtype_is_checked_at_parse_time():
    from boost_titan.train.config_check import parse_config

    toml = Path(__file__).resolve().parents[1] / "train_configs" / "debug_svd_loro.toml"
    base = ["--job.config_file", str(toml)]
    cfg = parse_config([*base, "--optimizer.loro_exact_dtype", "float32"])
    assert cfg.optimizer.loro_exact_dtype == "float32"
    with pytest.raises(
        ValueError,
        match=r"\[optimizer\] loro_exact_dtype = 'half' is not valid; "
        r"choose one of \['float64', 'float32'\]",
    ):
        parse_config([*base, "--optimizer.loro_exact_dtype", "half"])


def test_bench_pair_mode_extrapolates_the_spread_svd():
    """``boost-titan bench-loro --pair``'s model at the debug flavor (TP2 x
    FSDP2: 4 ranks share each pair): spreading saves (pairs - ceil(pairs / 4)) SVDs."""
    from boost_titan.perf.bench.loro import pair_report, report_pair

    res = pair_report("debugmodel", 2, 2, 1, 1, 0.4)
    assert res["pairs"] == 28 and res["shapes"]["256x256x64"] == ["wq", "wk", "wv", "wo"]
    for dtype in ("float64", "float32"):
        f = res[dtype]
        assert f["svd"] > 0 and f["rest"] > 0
        saved = f["exact_replicated"] - f["exact_spread"]
        assert saved == pytest.approx((28 - 7) * f["svd"])
    assert "K = 200" in report_pair(res) and "spread over 4 ranks" in report_pair(res)
