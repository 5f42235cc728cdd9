"""``transformers`` configuration of a boost_titan LLaMA (dense, SVD, CoLA or LaX).

Copied into every folder boost_titan exports in its ``boost`` layout; config.json's
``auto_map`` names it, so ``AutoConfig.from_pretrained(DIR, trust_remote_code=True)``
loads it. Imports only ``transformers``.
"""

from transformers import PretrainedConfig

ARCHITECTURES = ("dense", "svd", "cola", "lax")


class BoostLlamaConfig(PretrainedConfig):
    """LLaMA-2 shapes plus the low-rank fields: ``arch`` ("dense": W x; "svd": B A x;
    "cola": B silu(A x); "lax": latent crossing between blocks), ``rank`` of every
    projection but k/v, ``kv_rank`` of k and v, ``swiglu`` (False: the FFN is
    ``down(gate(x) * up(x))``), ``latent_act`` ("silu" or "none", applied to every
    latent), ``lax_gate`` ("kron" or "dense") and ``lax_norm_eps`` (LaX's latent
    LayerNorm)."""

    model_type = "boost_llama"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]

    def __init__(
        self,
        arch="dense",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=None,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_interleaved_scaling=None,
        max_position_embeddings=4096,
        rank=0,
        kv_rank=0,
        swiglu=True,
        latent_act="none",
        lax_gate="kron",
        lax_norm_eps=1e-6,
        initializer_range=0.02,
        use_cache=True,
        tie_word_embeddings=False,
        **kwargs,
    ):
        if arch not in ARCHITECTURES:
            raise ValueError(f"arch {arch!r}: use one of {list(ARCHITECTURES)}")
        self.arch = arch
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        # torchtitan's llama3 frequency rule, run with these constants (factor 1: no
        # scaling, but the same float ops as the trainer)
        self.rope_interleaved_scaling = rope_interleaved_scaling or {
            "factor": 1.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        self.max_position_embeddings = max_position_embeddings
        self.rank = rank
        self.kv_rank = kv_rank
        self.swiglu = swiglu
        self.latent_act = latent_act
        self.lax_gate = lax_gate
        self.lax_norm_eps = lax_norm_eps
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
