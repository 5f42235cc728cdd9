"""``transformers`` model of a boost_titan LLaMA: dense, SVD, CoLA and LaX.

Copied into every folder boost_titan exports in its ``boost`` layout; config.json's
``auto_map`` names it, so

    AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)

loads it with nothing installed but ``torch`` and ``transformers``. It computes what
``boost_titan.models.model.Transformer`` computes:

- parameter names are the trainer's FQNs under ``model.`` (``lm_head`` = ``output``);
- RoPE is torchtitan's llama3 RoPE: interleaved pairs (``x[2i], x[2i+1]``) rotated as
  complex numbers, frequencies from llama3's rule with scaling factor 1;
- a bottleneck projection is ``B act(A x)``; the trainer applies the block's RMSNorm to
  the A outputs (Online-RMSNorm, ``RMSNorm(x) A^T = ((x * g) A^T) / rms(x)``), which is
  the same function as ``A(RMSNorm(x))`` computed here;
- LaX (blocks >= 1): each latent is ``act(LayerNorm(A x + gate(previous block's latent of
  the same projection)))``, the gate a Kronecker product ``G1^T H G0`` (``kron``) or a
  dense ``r x r`` matrix (``dense``); the latents travel from block to block per token, so
  the KV cache needs nothing more than keys and values.

Attention is causal SDPA (GQA through ``enable_gqa``); ``generate()`` uses a
``DynamicCache``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

try:  # transformers 5: init functions that leave loaded weights alone
    from transformers import initialization as init
except ImportError:  # pragma: no cover - transformers 4
    from torch.nn import init

from .configuration_boost_llama import BoostLlamaConfig

# the cache's field in model outputs: "cache" from transformers 5.2x, "past_key_values" before
_CACHE_FIELD = (
    "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
)


def kron_factors(r: int) -> tuple[int, int]:
    """r = a * b with a <= b and a as large as possible (the trainer's rule)."""
    a = int(math.isqrt(r))
    while a > 1 and r % a:
        a -= 1
    return a, r // a


# ----------------------------------------------------------------------------- RoPE
def rope_frequencies(head_dim: int, theta: float, scaling: dict, device=None) -> torch.Tensor:
    """torchtitan's ``precompute_freqs_cis`` frequencies, float op for float op."""
    arange = torch.arange(0, head_dim, 2, device=device)
    freqs = 1.0 / (theta ** (arange[: (head_dim // 2)].float() / head_dim))
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / freqs
    high_freq_wavelen = original / high
    low_freq_wavelen = original / low
    freqs = torch.where(wavelen > low_freq_wavelen, freqs / factor, freqs)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * freqs / factor + smooth * freqs
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, freqs)


def rope_cis(freqs: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """[batch, seq, 1, head_dim / 2] complex rotations for ``position_ids`` [batch, seq]."""
    angles = (position_ids.to(freqs.device, torch.float32)[..., None] * freqs).float()
    return torch.polar(torch.ones_like(angles), angles).unsqueeze(2)


def apply_rope(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """x [batch, seq, heads, head_dim]: pairs (x[2i], x[2i+1]) times cis, as torchtitan."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * cis).flatten(3).type_as(x)


# ----------------------------------------------------------------------------- layers
class BoostRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rms_norm_after(x: torch.Tensor, norm: BoostRMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm split around a linear map L (the trainer's order for the A's):
    L(RMSNorm(x)) = L(x * g) * (1 / rms(x)). Returns (x * g, 1 / rms(x)) in float32."""
    sum_sq = x.float().pow(2).sum(-1, keepdim=True)
    return x * norm.weight, torch.rsqrt(sum_sq / x.shape[-1] + norm.eps)


class KroneckerGate(nn.Module):
    """h (r = a*b) viewed as H [a, b] -> G1^T H G0, flattened."""

    def __init__(self, r: int):
        super().__init__()
        self.a, self.b = kron_factors(r)
        self.g1 = nn.Parameter(torch.empty(self.a, self.a))
        self.g0 = nn.Parameter(torch.empty(self.b, self.b))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        H = h.unflatten(-1, (self.a, self.b))
        return (self.g1.t() @ H @ self.g0).flatten(-2)


class DenseGate(nn.Module):
    def __init__(self, r: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(r, r))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.weight)


class LatentCross(nn.Module):
    """LaX: LayerNorm_r(latent + gate(previous block's latent of this projection))."""

    def __init__(self, r: int, gate: str, eps: float):
        super().__init__()
        if gate not in ("kron", "dense"):
            raise ValueError(f"lax_gate {gate!r}: use one of ['kron', 'dense']")
        self.gate = KroneckerGate(r) if gate == "kron" else DenseGate(r)
        self.norm = nn.LayerNorm(r, eps=eps)

    def forward(self, latent: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        return self.norm(latent + self.gate(prev))


class Bottleneck(nn.Module):
    """``B act(A x)``; LaX's ``cross`` acts on the latent before the activation."""

    def __init__(self, din: int, dout: int, rank: int, act: str, cross: LatentCross | None):
        super().__init__()
        if act not in ("silu", "none"):
            raise ValueError(f"latent_act {act!r}: use one of ['silu', 'none']")
        self.down = nn.Linear(din, rank, bias=False)
        self.up = nn.Linear(rank, dout, bias=False)
        self.act = act
        self.cross = cross

    def latent(
        self, x: torch.Tensor, prev: torch.Tensor | None, scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The activated latent: B's input, and what LaX carries to the next block.
        ``scale``: the input's 1/rms when ``x`` is an RMSNorm's input times its gain."""
        z = self.down(x)
        if scale is not None:
            z = (z.float() * scale).type_as(z)
        if self.cross is not None:
            z = self.cross(z, prev)
        return F.silu(z) if self.act == "silu" else z


# the seven projections in the trainer's order (LaX's carried latents follow it)
ATTN_PROJS = ("wq", "wk", "wv", "wo")
FFN_PROJS = ("w1", "w3", "w2")
PROJ_ORDER = ATTN_PROJS + FFN_PROJS


def projection_shapes(config: BoostLlamaConfig) -> dict[str, tuple[int, int, int]]:
    d, f = config.hidden_size, config.intermediate_size
    head_dim = d // config.num_attention_heads
    kv_dim = config.num_key_value_heads * head_dim
    r, rkv = config.rank, config.kv_rank
    return {
        "wq": (d, config.num_attention_heads * head_dim, r),
        "wk": (d, kv_dim, rkv),
        "wv": (d, kv_dim, rkv),
        "wo": (config.num_attention_heads * head_dim, d, r),
        "w1": (d, f, r),
        "w3": (d, f, r),
        "w2": (f, d, r),
    }


class _Projections(nn.Module):
    """``attention`` (wq, wk, wv, wo) or ``feed_forward`` (w1, w3, w2): the trainer's FQNs."""

    def __init__(self, projs: dict[str, nn.Module]):
        super().__init__()
        for name, module in projs.items():
            setattr(self, name, module)


def attend(q, k, v, layer_idx, cache, attention_mask, past):
    """q [b, s, h, hd], k/v [b, s, kvh, hd] (after RoPE) -> [b, s, h * hd]: causal SDPA
    over the cached keys and values plus these."""
    b, s = q.shape[:2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if cache is not None:
        k, v = cache.update(k, v, layer_idx)
    total = k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    padded = attention_mask is not None and not bool(attention_mask.all())
    if not padded and total == s:  # no cache, no padding: the trainer's call
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    elif not padded and s == 1:  # one new token sees everything cached
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    else:
        qpos = torch.arange(past, past + s, device=q.device)[:, None]
        kpos = torch.arange(total, device=q.device)[None, :]
        mask = (kpos <= qpos)[None, None]  # [1, 1, s, total]
        if padded:
            keep = attention_mask[:, None, None, -total:].bool()
            # a padding query keeps its own key, so its row is never all-masked (NaN)
            mask = (mask & keep) | (kpos == qpos)[None, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return out.transpose(1, 2).reshape(b, s, -1)


class DenseBlock(nn.Module):
    def __init__(self, config: BoostLlamaConfig, layer_idx: int):
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.layer_idx = layer_idx
        self.head_dim = d // config.num_attention_heads
        kv_dim = config.num_key_value_heads * self.head_dim
        self.attention = _Projections(
            {
                "wq": nn.Linear(d, config.num_attention_heads * self.head_dim, bias=False),
                "wk": nn.Linear(d, kv_dim, bias=False),
                "wv": nn.Linear(d, kv_dim, bias=False),
                "wo": nn.Linear(config.num_attention_heads * self.head_dim, d, bias=False),
            }
        )
        self.feed_forward = _Projections(
            {
                "w1": nn.Linear(d, f, bias=False),
                "w2": nn.Linear(f, d, bias=False),
                "w3": nn.Linear(d, f, bias=False),
            }
        )
        self.attention_norm = BoostRMSNorm(d, config.rms_norm_eps)
        self.ffn_norm = BoostRMSNorm(d, config.rms_norm_eps)

    def forward(self, x, cis, prevs, cache, attention_mask, past):
        a, f = self.attention, self.feed_forward
        b, s, _ = x.shape
        hn = self.attention_norm(x)
        q = a.wq(hn).view(b, s, -1, self.head_dim)
        k = a.wk(hn).view(b, s, -1, self.head_dim)
        v = a.wv(hn).view(b, s, -1, self.head_dim)
        q, k = apply_rope(q, cis), apply_rope(k, cis)
        h = x + a.wo(attend(q, k, v, self.layer_idx, cache, attention_mask, past))
        hn = self.ffn_norm(h)
        # the trainer's dense FFN is always SwiGLU
        return h + f.w2(F.silu(f.w1(hn)) * f.w3(hn)), None


class LowRankBlock(nn.Module):
    def __init__(self, config: BoostLlamaConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.swiglu = config.swiglu
        lax = config.arch == "lax"
        projs = {}
        for name, (din, dout, r) in projection_shapes(config).items():
            cross = (
                LatentCross(r, config.lax_gate, config.lax_norm_eps) if lax and layer_idx else None
            )
            projs[name] = Bottleneck(din, dout, r, config.latent_act, cross)
        self.lax = lax
        self.attention = _Projections({n: projs[n] for n in ATTN_PROJS})
        self.feed_forward = _Projections({n: projs[n] for n in FFN_PROJS})
        self.attention_norm = BoostRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn_norm = BoostRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cis, prevs, cache, attention_mask, past):
        a, f = self.attention, self.feed_forward
        prev = prevs if prevs is not None else [None] * len(PROJ_ORDER)
        b, s, _ = x.shape
        xg, scale = rms_norm_after(x, self.attention_norm)
        zq, zk, zv = (p.latent(xg, pv, scale) for p, pv in zip((a.wq, a.wk, a.wv), prev[0:3]))
        q = a.wq.up(zq).view(b, s, -1, self.head_dim)
        k = a.wk.up(zk).view(b, s, -1, self.head_dim)
        v = a.wv.up(zv).view(b, s, -1, self.head_dim)
        q, k = apply_rope(q, cis), apply_rope(k, cis)
        o = attend(q, k, v, self.layer_idx, cache, attention_mask, past)
        zo = a.wo.latent(o, prev[3])
        h = x + a.wo.up(zo)
        hg, scale = rms_norm_after(h, self.ffn_norm)
        z1, z3 = f.w1.latent(hg, prev[4], scale), f.w3.latent(hg, prev[5], scale)
        gate, up = f.w1.up(z1), f.w3.up(z3)
        z2 = f.w2.latent((F.silu(gate) if self.swiglu else gate) * up, prev[6])
        out = h + f.w2.up(z2)
        return out, ([zq, zk, zv, zo, z1, z3, z2] if self.lax else None)


# ----------------------------------------------------------------------------- models
class BoostLlamaPreTrainedModel(PreTrainedModel):
    config_class = BoostLlamaConfig
    base_model_prefix = "model"
    _no_split_modules = ["DenseBlock", "LowRankBlock"]
    _supports_sdpa = True
    supports_gradient_checkpointing = False

    def _init_weights(self, module):
        # the usual small-normal init for a model built from a config alone; loading
        # a folder overwrites every parameter
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, (BoostRMSNorm, nn.LayerNorm)):
            init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)
        elif isinstance(module, KroneckerGate):
            init.kaiming_uniform_(module.g1, a=5**0.5)
            init.kaiming_uniform_(module.g0, a=5**0.5)
        elif isinstance(module, DenseGate):
            init.kaiming_uniform_(module.weight, a=5**0.5)


class BoostLlamaModel(BoostLlamaPreTrainedModel):
    """The trainer's ``Transformer`` without its LM head: ``tok_embeddings``, ``layers``,
    ``norm``."""

    def __init__(self, config: BoostLlamaConfig):
        super().__init__(config)
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        block = DenseBlock if config.arch == "dense" else LowRankBlock
        self.layers = nn.ModuleList(block(config, i) for i in range(config.num_hidden_layers))
        self.norm = BoostRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.tok_embeddings

    def set_input_embeddings(self, value):
        self.tok_embeddings = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        cache = kwargs.pop("past_key_values", None) if cache is None else cache
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if not use_cache:
            cache = None
        elif cache is None:
            cache = DynamicCache()
        h = self.tok_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + h.shape[1], device=h.device)[None]
        # float32 whatever the model's dtype, made here (a buffer would be rounded by
        # .to(dtype), and made on the meta device by from_pretrained)
        c = self.config
        freqs = rope_frequencies(
            c.hidden_size // c.num_attention_heads,
            c.rope_theta,
            c.rope_interleaved_scaling,
            h.device,
        )
        cis = rope_cis(freqs, position_ids)
        prevs = None
        for layer in self.layers:
            h, prevs = layer(h, cis, prevs, cache, attention_mask, past)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(h), **{_CACHE_FIELD: cache})


class BoostLlamaForCausalLM(BoostLlamaPreTrainedModel, GenerationMixin):
    _tied_weights_keys = None  # the trainer's LM head is its own matrix

    def __init__(self, config: BoostLlamaConfig):
        super().__init__(config)
        self.model = BoostLlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.tok_embeddings

    def set_input_embeddings(self, value):
        self.model.tok_embeddings = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        cache = kwargs.pop("past_key_values", None) if cache is None else cache
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
        )
        h = out.last_hidden_state
        if isinstance(logits_to_keep, int):
            h = h[:, -logits_to_keep:] if logits_to_keep else h
        else:
            h = h[:, logits_to_keep]
        logits = self.lm_head(h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
            )
        return CausalLMOutputWithPast(
            loss=loss, logits=logits, **{_CACHE_FIELD: getattr(out, _CACHE_FIELD)}
        )
