"""The low-rank model a conversion writes: the dense model's shapes, the config's
low-rank options.

Every shape comes from the dense model (its config.json, or a DCP step's recorded
``model_args.json``): dims, heads, FFN width, vocabulary, RMSNorm eps, RoPE theta and
scaling, context length. So the model converted at full rank computes the dense one,
whatever flavor the config names. The config (``[model] name``, ``[boost]``) gives the
architecture and its options (SwiGLU, latent activation, LaX gate); the rank is
``[boost] rank`` / ``rank_ratio`` (``--rank``), else the flavor's when the dense model
has that flavor's shapes; otherwise the conversion is refused, naming the shapes.
"""

from __future__ import annotations

from dataclasses import replace

from boost_titan.models.args import LlamaArgs

# what the dense model decides
SHAPE_FIELDS = (
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "vocab_size",
    "ffn_dim",
    "norm_eps",
    "rope_theta",
    "rope_scaling_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_positions",
    "max_positions",
)
# what must agree for the flavor's rank to carry over to the dense model
RANK_SHAPES = ("dim", "n_layers", "n_heads", "kv_heads", "ffn_dim", "vocab_size")


def with_shapes(args: LlamaArgs, dense: LlamaArgs) -> LlamaArgs:
    """``args`` (a flavor, its options) at ``dense``'s shapes."""
    return replace(args, **{k: getattr(dense, k) for k in SHAPE_FIELDS})


def shape_diff(dense: LlamaArgs, flavor: LlamaArgs) -> list[str]:
    return [
        f"{k} {getattr(dense, k)} (flavor: {getattr(flavor, k)})"
        for k in RANK_SHAPES
        if getattr(dense, k) != getattr(flavor, k)
    ]


def target_args(
    dense: LlamaArgs,
    flavor: LlamaArgs,
    boost,
    where: str,
    desc: str,
    named: LlamaArgs | None = None,
) -> LlamaArgs:
    """``flavor`` (the config's model after its [boost] options) at ``dense``'s shapes;
    ``named``: the flavor's own shapes, when ``flavor`` is already at ``dense``'s (whether
    the flavor's rank carries over)."""
    target = with_shapes(flavor, dense)
    if boost.rank or boost.rank_ratio:
        rank = boost.rank or max(1, round(boost.rank_ratio * dense.dim))
        target = replace(target, rank=rank, kv_rank=boost.kv_rank)
    else:
        diff = shape_diff(dense, named or flavor)
        if diff:
            raise ValueError(
                f"{where} does not have the shapes of {desc} ({', '.join(diff)}), so its "
                f"rank does not apply: give --rank R (1 .. {min(dense.dim, dense.ffn_dim)}; "
                f"the flavors take dim/4 = {dense.dim // 4})"
            )
    target.validate()
    return target
