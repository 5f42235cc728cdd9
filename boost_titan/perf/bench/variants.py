"""The benchmark's variants: which model, TP plan and options each one is, its shapes,
how to build it on a mesh (eager or compiled) and run one training step of it."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

VARIANTS = {
    # id: (architecture, plan, group_linears, rmsnorm, activation checkpointing);
    # plan "btp_sp": btp with [boost] sequence_parallel (the planner's name for it).
    # An id is the one spelling of a variant everywhere: the --variants value, the keys
    # of raw.json and results.json, results.md's rows, the TensorBoard run tb/<id>/.
    "btp": ("cola", "btp", True, "online", "none"),
    "btp-sp": ("cola", "btp_sp", True, "online", "none"),
    "vanilla": ("cola", "vanilla", True, "online", "none"),
    "fullrank": ("dense", "fullrank", True, "online", "none"),
    "btp-ungrouped": ("cola", "btp", False, "online", "none"),
    "btp-sync-norm": ("cola", "btp", True, "sync", "none"),
    "btp-latent-ckpt": ("cola", "btp", True, "online", "latent"),
    "btp-latent-ckpt-recompute-attn": ("cola", "btp", True, "online", "latent recompute-attn"),
    "btp-full-ac": ("cola", "btp", True, "online", "full"),
    "vanilla-full-ac": ("cola", "vanilla", True, "online", "full"),
}
DESCRIPTIONS = {  # id -> what it is, for results.md's legend
    "btp": "CoLA model, BTP plan (grouped latent linears, Online-RMSNorm)",
    "btp-sp": "btp with sequence-parallel latents ([boost] sequence_parallel)",
    "vanilla": "the same CoLA model, vanilla low-rank TP",
    "fullrank": "full-rank dense twin, torchtitan Megatron+SP plan",
    "btp-ungrouped": "btp without grouped latent linears",
    "btp-sync-norm": "btp with synchronous RMSNorm (rmsnorm = sync)",
    "btp-latent-ckpt": "btp with latent checkpointing, attention output kept",
    "btp-latent-ckpt-recompute-attn": "btp with latent checkpointing, attention recomputed",
    "btp-full-ac": "btp with torchtitan's full activation checkpointing",
    "vanilla-full-ac": "vanilla with torchtitan's full activation checkpointing",
}
DEFAULT_VARIANTS = (
    "btp",
    "vanilla",
    "fullrank",
    "btp-ungrouped",
    "btp-sync-norm",
    "btp-sp",
)
AC_VARIANTS = (
    "btp",
    "btp-latent-ckpt",
    "btp-latent-ckpt-recompute-attn",
    "btp-full-ac",
    "vanilla",
    "vanilla-full-ac",
)
GROUPS = {"default": DEFAULT_VARIANTS, "ac": AC_VARIANTS}  # --variants shorthands
# the names before the variants had ids (published results under benchmarks/ keep them)
RENAMED = {
    "btp sp": "btp-sp",
    "fullrank (dense twin)": "fullrank",
    "btp ungrouped": "btp-ungrouped",
    "btp sync-norm": "btp-sync-norm",
    "btp latent-ckpt": "btp-latent-ckpt",
    "btp latent-ckpt recompute-attn": "btp-latent-ckpt-recompute-attn",
    "btp full-ac": "btp-full-ac",
    "vanilla full-ac": "vanilla-full-ac",
}
COMPILED = "-compiled"  # suffix of a variant's torch.compile'd twin: btp -> btp-compiled


def resolve_variants(spec: str) -> list[str]:
    """``--variants``' comma list of ids and group names -> the ids, in order, each once;
    ValueError naming the first unknown entry (and its id, if it is an old name)."""
    names: list[str] = []
    for item in (s.strip() for s in spec.split(",")):
        for n in GROUPS.get(item, (item,)):
            if n not in VARIANTS:
                raise ValueError(_unknown(n))
            if n not in names:
                names.append(n)
    return names


def _unknown(name: str) -> str:
    if name in RENAMED:
        hint = f" (renamed: use {RENAMED[name]!r})"
    elif is_compiled(name) and base_name(name) in VARIANTS:
        hint = f" (compiled twins come from --compile: use {base_name(name)!r} with --compile)"
    else:
        hint = ""
    return (
        f"unknown benchmark variant {name!r}{hint}; valid: {', '.join(VARIANTS)}; "
        f"groups: {', '.join(GROUPS)}"
    )


def compiled_name(name: str) -> str:
    return name + COMPILED


def base_name(name: str) -> str:
    """The VARIANTS key of a (possibly compiled) variant id."""
    return name.removesuffix(COMPILED)


def is_compiled(name: str) -> bool:
    return name.endswith(COMPILED)


def with_compiled(names: list[str], tp: int) -> tuple[list[str], dict[str, str]]:
    """Each variant followed by its compiled twin (interleaved repetitions then time
    both back to back, and every table lists them side by side), and the variants
    that get no twin because torch cannot compile them correctly: {name: why}."""
    out, refused = [], {}
    for n in names:
        out.append(n)
        why = compile_refusal(n, tp)
        if why:
            refused[n] = why
        else:
            out.append(compiled_name(n))
    return out, refused


def compile_refusal(name: str, tp: int) -> str | None:
    """Why the trainer would refuse to compile this variant at TP ``tp`` (the same
    check, ``boost_titan.parallel.compile.check_compile_config``), or None."""
    from boost_titan.parallel.compile import check_compile_config

    ac = VARIANTS[base_name(name)][4]
    latent = ac.startswith("latent")
    config = SimpleNamespace(
        compile=SimpleNamespace(enable=True, components=["model", "loss"], backend="inductor"),
        parallelism=SimpleNamespace(tensor_parallel_degree=tp),
        activation_checkpoint=SimpleNamespace(mode="full" if ac == "full" else "none"),
        boost=SimpleNamespace(
            latent_checkpoint="both" if latent else "none",
            latent_checkpoint_keep="none" if ac.endswith("recompute-attn") else "attention",
        ),
    )
    try:
        check_compile_config(config)
    except ValueError as e:
        return str(e)
    return None


@dataclass
class Shape:
    dim: int = 1024
    ffn_dim: int = 2736
    n_heads: int = 16
    rank: int = 256
    n_layers: int = 4
    vocab_size: int = 8192
    batch: int = 4
    seq: int = 1024

    def args(self, arch: str, grouped: bool = True):
        """The model args of ``arch`` ("dense", "svd", "cola", "lax") at this shape."""
        from boost_titan.models.args import LlamaArgs

        return LlamaArgs(
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            ffn_dim=self.ffn_dim,
            vocab_size=self.vocab_size,
            max_seq_len=self.seq,
            arch=arch,
            rank=self.rank if arch != "dense" else 0,
            norm_eps=1e-6,
            group_linears=grouped,
        )


SMOKE = Shape(dim=128, ffn_dim=344, n_heads=8, rank=32, n_layers=2, vocab_size=512, batch=2, seq=64)


def build_variant(name: str, shape: Shape, mesh, device, backend: str = "inductor"):
    """Model, AdamW, parameter bytes per rank and loss function of a variant; a
    compiled twin (``<id>-compiled``) is compiled after TP and checkpointing, as the
    trainer does."""
    from torch.distributed.tensor import DTensor

    from boost_titan.models.model import Transformer
    from boost_titan.tp_plans import apply_tp_plan

    arch, plan, grouped, norm, ac = VARIANTS[base_name(name)]
    args = shape.args(arch, grouped)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(args)
    # the trainer's entry: checks the TP degree divides what the plan splits, then applies it
    sequence_parallel = plan == "btp_sp"
    plan = "btp" if sequence_parallel else plan
    job_config = SimpleNamespace(
        boost=SimpleNamespace(
            rmsnorm=norm,
            sequence_parallel=sequence_parallel,
            sequence_parallel_keep_gathered=False,
        )
    )
    apply_tp_plan(plan, model, mesh, loss_parallel=True, job_config=job_config)
    if ac.startswith("latent"):
        from boost_titan.parallel.latent_checkpoint import apply_latent_checkpointing

        keep = "none" if ac.endswith("recompute-attn") else "attention"
        apply_latent_checkpointing(model, "both", keep=keep, plan=plan, norm_mode=norm)
    elif ac == "full":  # torchtitan's full AC: every block recomputed whole
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for layer_id, block in list(model.layers.named_children()):
            model.layers.register_module(
                layer_id, checkpoint_wrapper(block, preserve_rng_state=False)
            )
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    loss_fn = lm_loss
    if is_compiled(name):
        from boost_titan.parallel.compile import apply_compile

        apply_compile(model, SimpleNamespace(backend=backend))
        loss_fn = torch.compile(
            lm_loss, backend=backend
        )  # as torchtitan's build_cross_entropy_loss
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    param_bytes = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
        for p in model.parameters()
    )
    return model, opt, param_bytes, loss_fn


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The benchmark's loss: token-mean cross-entropy (loss-parallel on sharded logits)."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def train_step(model, opt, tokens, labels, loss_fn=lm_loss):
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        loss = loss_fn(model(tokens), labels)
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
