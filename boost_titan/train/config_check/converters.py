"""[model] converters: the names torchtitan registered, what they would convert in a
boost_titan model, and (where training starts) what they need of the machine.

torchtitan 0.2.2 looks a name up only when it builds the model: an unknown one (its
docs say "the `float8` converter"; the registered name is ``quantize.linear.float8``)
was a ``KeyError: 'float8'`` traceback per rank (137 lines on 2 ranks), and a known
one on a machine without its GPU or without torchao another traceback per rank."""

from __future__ import annotations

import importlib.util

from boost_titan.train.config_check.common import bad

# converter kind -> (the CUDA compute capability it needs, what that is): torchtitan
# 0.2.2's own checks (components/quantization/float8.py, mx.py)
_NEEDS = {
    "float8": ((8, 9), "float8 (compute capability 8.9 or later: Ada, Hopper, Blackwell)"),
    "mx": ((10, 0), "MXFP8 (compute capability 10.0 or later: Blackwell)"),
}


def _registry() -> dict:
    import torchtitan.components.quantization  # noqa: F401 (registers the quantizers)
    from torchtitan.protocols.model_converter import _registry_model_converter_cls

    return _registry_model_converter_cls


def check_converter_names(config) -> None:
    """Every name registered (an unknown one: the valid names, and those that mean
    the same word, e.g. 'float8')."""
    names, registry = config.model.converters, _registry()
    for name in names:
        if name not in registry:
            alike = sorted(k for k in registry if name in k.split("."))
            hint = f"; for {name!r} use one of {alike}" if alike else ""
            raise bad(
                "model",
                "converters",
                names,
                f"names {name!r}, which is not a model converter of torchtitan; "
                f"valid: {sorted(registry)}{hint}",
            )


def check_converters_for(config, model_args, what: str) -> None:
    """What a quantizer would convert in a boost_titan model: refused where it would
    convert nothing or not what the log says."""
    for name in config.model.converters:
        if name.startswith("quantize.grouped_mm."):
            raise bad(
                "model",
                "converters",
                config.model.converters,
                f"names {name!r}, which converts MoE experts' grouped GEMMs; {what} has "
                "no experts (dense blocks): it would convert nothing",
            )
        if name.startswith("quantize.linear.") and model_args.low_rank:
            # the factors are nn.Linear modules and torchao's filter (dims divisible
            # by 16) would swap them for Float8Linear / MXLinear, but the blocks read
            # their weights with F.linear (grouped projections, BTP's latent
            # collectives): the swapped modules' forward, where the cast is, never runs
            raise bad(
                "model",
                "converters",
                config.model.converters,
                f"names {name!r}, which {what} cannot use: its blocks read the bottleneck "
                "factors' weights directly (F.linear in the grouped projections and BTP's "
                "latent collectives), so the converted Float8Linear/MXLinear modules would "
                "never run and only the output layer would be quantized; train low-rank "
                "models without [model] converters",
            )


def check_converters_run_here(config) -> None:
    """What this machine lacks for a quantizer, checked where training starts (not
    when a config is parsed: the dry run plans GPU layouts on a CPU): its CUDA
    compute capability and torchao."""
    import torch

    for name in config.model.converters:
        kind = name.rpartition(".")[2]
        if not name.startswith("quantize.") or kind not in _NEEDS:
            continue
        need, gpu_kind = _NEEDS[kind]
        cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
        emulated = (
            name == "quantize.linear.float8"
            and config.quantize.linear.float8.emulate
            and not (config.compile.enable and "model" in config.compile.components)
        )  # torchtitan's float8 emulation: any device, eager only
        torchao = importlib.util.find_spec("torchao") is not None
        if torchao and (emulated or (cap is not None and cap >= need)):
            continue
        here = "no CUDA GPU" if cap is None else f"a GPU of compute capability {cap[0]}.{cap[1]}"
        missing = [] if torchao else ["torchao is not installed (pip install torchao)"]
        if not emulated and (cap is None or cap < need):
            missing.insert(0, f"this machine has {here}")
        raise bad(
            "model",
            "converters",
            config.model.converters,
            f"names {name!r}, which needs a CUDA GPU with {gpu_kind} and torchao; "
            + "; ".join(missing),
        )
