"""The machine a check ran on: library and driver versions (``versions``), and the
refusal to run the full-size check without CUDA (``require_cuda``)."""

from __future__ import annotations

import platform
import shutil
import subprocess

import torch

from boost_titan.config import refuse


def versions() -> dict:
    """torch, CUDA, cuDNN, NCCL, Triton, driver (None where absent, with why)."""
    from importlib.metadata import PackageNotFoundError, version

    cuda = torch.cuda.is_available()

    def pkg(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchtitan": pkg("torchtitan"),
        "cuda": torch.version.cuda,  # the toolkit torch was built with; None: CPU wheel
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "triton": triton_version,
        "driver": _driver() if cuda else None,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if cuda
        else [],
    }


def _driver() -> str:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return "unknown (nvidia-smi not on PATH)"
    try:
        out = subprocess.run(
            [exe, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown (nvidia-smi: {e})"
    lines = out.stdout.split()
    return (
        lines[0] if out.returncode == 0 and lines else f"unknown (nvidia-smi rc {out.returncode})"
    )


def require_cuda(smoke: bool) -> None:
    """The full check runs 350m models and 7B GEMM shapes with inductor: on a CPU that
    takes hours. Refuse, naming what works, unless ``--smoke``."""
    if smoke or torch.cuda.is_available():
        return
    refuse(
        "boost-titan gpu-check",
        f"no CUDA device visible (torch {torch.__version__}, built with CUDA "
        f"{torch.version.cuda}); the full check runs full-size models with inductor and "
        "would take hours on a CPU. Run it on a GPU machine, or add --smoke for the same "
        "code paths on CPU with tiny shapes.",
    )
