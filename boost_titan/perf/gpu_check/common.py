"""What every section shares: tolerances, the run's sizes (``Sizes``, ``SMOKE``),
building a seeded model from a flavor and compiling it as the trainer does, peak
memory, and running a part so that its failure is reported, not fatal."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from types import SimpleNamespace

import torch

ARCHS = ("dense", "svd", "cola", "lax")
THROUGHPUT_ARCHS = ("cola", "dense")
LOSS_RTOL = 1e-4  # compiled vs eager loss, relative (fp32)
GRAD_RTOL = 1e-3  # compiled vs eager gradients: max |diff| / max |eager| per parameter
NUMERIC_STEPS = 2  # the second step checks the compiled graphs see the updated weights
LOCAL_TENSOR_NOTE = (
    "simulated TP (fake process group + LocalTensorMode) cannot be compiled with torch "
    f"{torch.__version__}: AOTAutograd fails on LocalTensor x FunctionalTensor"
)
# in the order they run; a failing section's exit status is 10 + its index here
SECTIONS = ("numerics", "tp2", "btp", "sdpa", "gemm", "throughput", "trainer")


@dataclass(frozen=True)
class Sizes:
    """Shapes and step counts of one check run."""

    numerics_flavor: str = "debugmodel"  # d 256, 4 layers, vocab 8192
    numerics_dim: int | None = None  # None: the flavor's
    numerics_batch: int = 4
    numerics_seq: int = 256
    tp2_archs: tuple[str, ...] = ARCHS
    btp_layers: int = 24  # > Dynamo's recompile limit (8): a per-block guard fails there
    btp_dim: int | None = None  # None: the numerics flavor's (debugmodel: 256)
    btp_batch: int = 4
    btp_seq: int = 256
    throughput_flavor: str = "350m"
    throughput_dim: int | None = None
    throughput_batch: int = 8
    throughput_seq: int = 2048
    warmup: int = 3  # untimed steps after the compiling one
    steps: int = 10
    gemm_dtype: str = "bfloat16"
    gemm_m_scale: float = 1.0
    gemm_seconds: float = 0.2
    trainer_steps: int = 10  # NGPU=1 ./run_train.sh, debug config, compiled
    trainer_profile_freq: int = 5  # step profiler on steps 2, 5, 10


# CPU: tiny shapes, same code paths (tests/test_bench.py runs it)
# (TP2: one architecture per plan, full-rank and BTP; tracing DTensor code is slow)
SMOKE = Sizes(
    numerics_dim=128,
    numerics_batch=2,
    numerics_seq=32,
    tp2_archs=("dense", "cola"),
    btp_layers=9,  # one past the recompile limit: still fails on a per-block guard
    btp_dim=64,
    btp_batch=2,
    btp_seq=32,
    throughput_flavor="debugmodel",
    throughput_dim=128,
    throughput_batch=2,
    throughput_seq=64,
    warmup=1,
    steps=2,
    gemm_dtype="float32",
    gemm_m_scale=0.002,
    gemm_seconds=0.02,
    trainer_steps=4,
    trainer_profile_freq=4,  # steps 2 and 4
)


# ----------------------------------------------------------------------------- building
def model_args(arch: str, flavor: str, seq: int, dim: int | None):
    """A flavor's LlamaArgs; ``dim`` set shrinks it to 2 blocks of that width (smoke)."""
    from boost_titan.models.flavors import flavors_for

    args = copy.deepcopy(flavors_for(arch)[flavor])
    args.max_seq_len = seq
    if dim is not None:
        # ffn ~ 8d/3 rounded up to a multiple of 8: divisible by the TP degree
        args.dim, args.ffn_dim, args.vocab_size, args.n_layers = (
            dim,
            -(-dim * 8 // 3 // 8) * 8,
            512,
            2,
        )
        if args.low_rank:
            args.rank = dim // 4
    args.validate()
    return args


def build_model(args, device: torch.device, plan_fn=None):
    """Seeded weights, identical for every build of the same args; ``plan_fn(model)``
    (a TP plan) is applied on the meta model, before weights exist."""
    from boost_titan.models.model import Transformer

    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(args)
    if plan_fn is not None:
        plan_fn(model)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    return model


def compile_like_trainer(model, backend: str):
    """The model's blocks and the loss compiled as the trainer does; returns the loss."""
    from torchtitan.components.loss import cross_entropy_loss

    from boost_titan.parallel.compile import apply_compile

    apply_compile(model, SimpleNamespace(backend=backend))
    return torch.compile(cross_entropy_loss, backend=backend)


def batch(vocab: int, b: int, s: int, device: torch.device):
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, vocab, (b, s), generator=g)
    labels = torch.randint(0, vocab, (b, s), generator=g)
    return tokens.to(device), labels.to(device)


# ----------------------------------------------------------------------------- running
class PeakMemory:
    """Peak memory from ``start()``: CUDA max allocated, or the CPU peak RSS rise."""

    def __init__(self, device: torch.device):
        self.device, self.base = device, 0

    @property
    def source(self) -> str:
        return (
            "torch.cuda.max_memory_allocated"
            if self.device.type == "cuda"
            else "peak RSS rise (CPU)"
        )

    def start(self) -> None:
        from boost_titan.parallel.cpu_runtime import current_rss_bytes, reset_peak_rss

        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = 0  # absolute: everything the run holds on the GPU
        else:
            self.base = current_rss_bytes()
            reset_peak_rss()

    def peak_mib(self) -> float:
        from boost_titan.parallel.cpu_runtime import peak_rss_bytes

        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        return max(0, peak_rss_bytes() - self.base) / 2**20


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def fail_rather_than_fall_back() -> None:
    """Past dynamo's recompile limit a block would silently run eager, and eager
    numbers would be reported as compiled: make that an error instead."""
    torch._dynamo.config.fail_on_recompile_limit_hit = True


def guarded(fn, *args) -> dict:
    """``fn(*args)``, or its error: one failing part must not cost a GPU session the
    results of the others."""
    import traceback

    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - reported in the results and the exit status
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"[:2000]}


def release(device: torch.device) -> None:
    """Forget compiled graphs and cached memory between runs: each run starts alike."""
    import gc

    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
