"""The GPUs the step-time model (:mod:`boost_titan.perf.step_time`) and the layout search
know, in one table, each figure from the vendor's datasheet; a custom GPU from a TOML
file (``--gpu-file my_gpu.toml``).

Figures are the datasheets' headline numbers: dense bf16 tensor-core FLOP/s (the
datasheets print the 2:4-sparse figure, twice this, with an asterisk), HBM bandwidth,
memory, NVLink bandwidth per GPU (both directions together, as NVIDIA prints it; a ring
collective sends one way at a time, so the model uses half) and the inter-node network
per GPU (one NIC per GPU in NVIDIA's reference systems). What a kernel or a collective
reaches of these is the model's business (its fitted fractions), not this table's.

Memory is in GiB: HBM stacks come in binary sizes, so the "80GB" of the datasheets is
80 GiB (``nvidia-smi`` shows 81920 MiB on an A100 80GB); the dry run's headroom covers
what the driver reserves.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class GPU:
    name: str
    peak_bf16_flops: float  # dense, FLOP/s
    hbm_bytes_per_s: float
    memory_gib: float
    nvlink_bytes_per_s: float  # per GPU, both directions together (the datasheet figure)
    internode_bits_per_s: float  # per GPU (its NIC)
    gpus_per_node: int = 8  # the vendor's reference node (HGX/DGX board)
    # True: NVSwitch (any group of a node's GPUs gets the GPU's whole NVLink bandwidth);
    # False: a point-to-point mesh (the 4-GPU HGX A100 board): the GPU's links split
    # evenly among its gpus_per_node - 1 peers, so a group of n gets (n - 1) of them
    nvswitch: bool = True

    @property
    def nvlink_one_way(self) -> float:
        """What one GPU can send at once: half the bidirectional NVLink figure."""
        return self.nvlink_bytes_per_s / 2

    def nvlink_group_one_way(self, n: int) -> float:
        """One-way NVLink bandwidth per GPU inside a group of ``n`` GPUs of a node."""
        if self.nvswitch:
            return self.nvlink_one_way
        return self.nvlink_one_way * min(n - 1, self.gpus_per_node - 1) / (self.gpus_per_node - 1)

    @property
    def internode_bytes_per_s(self) -> float:
        return self.internode_bits_per_s / 8


GPUS: dict[str, GPU] = {
    # NVIDIA A100 Tensor Core GPU datasheet (nvidia.com, "a100-80gb-datasheet-update",
    # 2021): BF16 Tensor Core 312 TFLOPS (624 sparse); GPU memory bandwidth A100 40GB SXM
    # 1,555 GB/s, A100 80GB SXM 2,039 GB/s; NVLink 600 GB/s (3rd generation, 12 links);
    # the DGX A100 datasheet: 8x ConnectX-6 200 Gb/s HDR InfiniBand, one per GPU.
    # The BOOST paper's Perlmutter nodes: 4x A100 40GB SXM4 and 4x 200 Gb/s Slingshot-11
    # NICs per node (NERSC Perlmutter architecture page): the same 200 Gb/s per GPU.
    "a100-40": GPU("a100-40", 312e12, 1555e9, 40, 600e9, 200e9),
    # Perlmutter's node itself (the paper's machine): the 4-GPU HGX A100 board has no
    # NVSwitch; each pair of GPUs shares 4 of the 12 NVLink3 links (100 GB/s each way),
    # so TP2 reaches a third of the GPU's NVLink, TP4 all of it (NERSC Perlmutter
    # architecture page: "4x NVIDIA A100 ... connected by NVLink-3", 4 Slingshot NICs).
    "a100-40-hgx4": GPU("a100-40-hgx4", 312e12, 1555e9, 40, 600e9, 200e9, 4, False),
    "a100-80": GPU("a100-80", 312e12, 2039e9, 80, 600e9, 200e9),
    # NVIDIA H100 Tensor Core GPU datasheet (nvidia.com, "h100-datasheet", 2023), H100 SXM:
    # BF16 Tensor Core 1,979 TFLOPS with sparsity (989.5 dense), GPU memory 80GB, bandwidth
    # 3.35 TB/s, NVLink 900 GB/s (4th generation); DGX H100 datasheet: 8x ConnectX-7
    # 400 Gb/s NDR InfiniBand, one per GPU.
    "h100-80": GPU("h100-80", 989.5e12, 3.35e12, 80, 900e9, 400e9),
    # NVIDIA H200 Tensor Core GPU datasheet (nvidia.com, "h200-datasheet", 2024), H200 SXM:
    # BF16 Tensor Core 1,979 TFLOPS with sparsity (989.5 dense), GPU memory 141GB,
    # bandwidth 4.8 TB/s, NVLink 900 GB/s; DGX H200: 8x ConnectX-7 400 Gb/s, one per GPU.
    # (141 GB decimal; nvidia-smi reports ~140 GiB: 140 here.)
    "h200": GPU("h200", 989.5e12, 4.8e12, 140, 900e9, 400e9),
}

# the TOML keys of a custom GPU, what each means, and its unit
TOML_KEYS = {
    "name": "a label",
    "peak_bf16_flops": "dense bf16 FLOP/s, e.g. 989.5e12",
    "hbm_bytes_per_s": "HBM bandwidth in bytes/s, e.g. 3.35e12",
    "memory_gib": "GPU memory in GiB, e.g. 80",
    "nvlink_bytes_per_s": "NVLink bytes/s per GPU, both directions (datasheet), e.g. 900e9",
    "internode_bits_per_s": "network bits/s per GPU, e.g. 400e9",
    "gpus_per_node": "GPUs per node (optional, default 8)",
    "nvswitch": "true: NVSwitch; false: point-to-point NVLink mesh (optional, default true)",
}


def gpu(name: str) -> GPU:
    if name not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; valid: {sorted(GPUS)} (or --gpu-file X.toml)")
    return GPUS[name]


def load_gpu_file(path: str) -> GPU:
    """A custom GPU from a TOML file with the keys of :data:`TOML_KEYS` at top level
    (or under ``[gpu]``); every error is one line naming the key and what is valid."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"--gpu-file {path}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--gpu-file {path}: not valid TOML ({e})") from None
    data = data.get("gpu", data)
    unknown = sorted(set(data) - set(TOML_KEYS))
    if unknown:
        raise ValueError(f"--gpu-file {path}: unknown key {unknown[0]!r}; valid: {list(TOML_KEYS)}")
    required = [f.name for f in fields(GPU) if f.name not in ("gpus_per_node", "nvswitch")]
    missing = [k for k in required if k not in data]
    if missing:
        raise ValueError(f"--gpu-file {path}: missing key {missing[0]!r} ({TOML_KEYS[missing[0]]})")
    if not isinstance(data["name"], str):
        raise ValueError(f"--gpu-file {path}: name = {data['name']!r} must be a string")
    for key in required[1:] + ["gpus_per_node"]:
        if key not in data:
            continue
        v = data[key]
        if isinstance(v, bool) or not isinstance(v, int | float) or v <= 0:
            raise ValueError(
                f"--gpu-file {path}: {key} = {v!r} must be a positive number ({TOML_KEYS[key]})"
            )
    if not isinstance(data.get("gpus_per_node", 8), int):
        raise ValueError(
            f"--gpu-file {path}: gpus_per_node = {data['gpus_per_node']!r} must be an integer"
        )
    if not isinstance(data.get("nvswitch", True), bool):
        raise ValueError(
            f"--gpu-file {path}: nvswitch = {data['nvswitch']!r} must be true or false"
        )
    keep = ("name", "gpus_per_node", "nvswitch")
    return GPU(**{k: (v if k in keep else float(v)) for k, v in data.items()})


def resolve_gpu(name: str | None, path: str | None) -> GPU:
    return load_gpu_file(path) if path else gpu(name or "a100-40")
