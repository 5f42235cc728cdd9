"""Register boost_titan's train specs (and datasets) with torchtitan.

llama2       dense LLaMA-2 baseline (full-rank TP)
svd_llama2   B (A x)
cola_llama2  B silu(A x)
lax_llama2   CoLA with latent crossing between blocks
"""

from __future__ import annotations

from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.tokenizer import build_hf_tokenizer
from torchtitan.components.validate import Validator
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.protocols.train_spec import TrainSpec, _extra_train_specs, register_train_spec

from boost_titan.checkpoint.hf.adapters import adapter_for
from boost_titan.checkpoint.model_args import flavor_at, is_flavor_path
from boost_titan.config import ConfigError
from boost_titan.data import datasets
from boost_titan.data.loader import build_dataloader
from boost_titan.models.flavors import MODEL_ARCH, flavors_for
from boost_titan.models.model import Transformer
from boost_titan.optim import build_optimizers
from boost_titan.parallel import cpu_runtime
from boost_titan.parallel.parallelize import parallelize_boost
from boost_titan.parallel.pipeline import build_loss_fn


class FlavorTable(dict):
    """Flavor lookup: a built-in name, or a path (a converted step's recorded model
    arguments, a Hugging Face folder: ``boost_titan.checkpoint.model_args``), read anew at
    each lookup (callers mutate what they get). An unknown name's KeyError lists the
    valid flavors."""

    def __init__(self, model_name: str, table):
        super().__init__(table)
        self.model_name = model_name

    def __contains__(self, key) -> bool:
        return super().__contains__(key) or (isinstance(key, str) and is_flavor_path(key))

    def __missing__(self, key):
        if isinstance(key, str) and is_flavor_path(key):
            try:
                return flavor_at(key, MODEL_ARCH[self.model_name], self.model_name)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        raise KeyError(
            f"unknown flavor {key!r} for model {self.model_name!r}; valid flavors: {sorted(self)}"
        )


class RepeatableValidator(Validator):
    """torchtitan's Validator, scoring the same held-out batches at every validation.

    With ``validation.steps`` set, torchtitan keeps one endless validation stream that
    moves on between passes (and is not checkpointed), so successive validation losses
    come from different batches and a resumed run scores yet others. Rewinding the
    stream to its start before each pass makes validation losses comparable
    (boost_titan's own validation loader starts every pass at its first window)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        loader = self.validation_dataloader
        restarts = getattr(loader, "restarts_each_pass", False)
        self._start_state = None if restarts else loader.state_dict()

    def validate(self, model_parts, step):
        if self._start_state is not None:
            self.validation_dataloader.load_state_dict(self._start_state)
        dims = self.parallel_dims
        if dims.cp_enabled:
            self.parallel_dims = _TokensCountedOverCP(dims)
        try:
            return super().validate(model_parts, step)
        finally:
            self.parallel_dims = dims


class _TokensCountedOverCP:
    """torchtitan 0.2.2's validator under context parallelism divides each rank's loss
    sum by the valid tokens of the data-parallel ranks only (the "batch" mesh), then
    sums the quotients over dp x cp: the logged validation loss is cp times the mean
    (measured: 18.78 for 9.46 at CP2). Counting the tokens over dp x cp (the "loss"
    mesh) makes each quotient a share of the mean. The training step counts them
    correctly; only the validator reads ParallelDims through this view."""

    def __init__(self, dims):
        self._dims = dims

    def __getattr__(self, name):
        return getattr(self._dims, name)

    @property
    def dp_enabled(self) -> bool:
        return True  # the token count is summed (over the mesh below)

    def get_mesh(self, dims):
        return self._dims.get_mesh("loss" if dims == "batch" else dims)


def build_validator(**kwargs) -> Validator:
    return RepeatableValidator(**kwargs)


def build_train_spec(model_name: str) -> TrainSpec:
    return TrainSpec(
        model_cls=Transformer,
        model_args=FlavorTable(model_name, flavors_for(MODEL_ARCH[model_name])),
        parallelize_fn=parallelize_boost,
        pipelining_fn=pipeline_llm,
        build_optimizers_fn=build_optimizers,
        build_lr_schedulers_fn=build_lr_schedulers,
        build_dataloader_fn=build_dataloader,
        build_tokenizer_fn=build_hf_tokenizer,
        build_loss_fn=build_loss_fn,
        build_validator_fn=build_validator,
        build_metrics_processor_fn=cpu_runtime.build_metrics_processor,
        # [checkpoint] last_save_in_hf / initial_load_in_hf: boost_titan/checkpoint/hf/adapters.py
        state_dict_adapter=adapter_for(model_name),
    )


def register_all() -> None:
    """Register every model and dataset with torchtitan (idempotent). The entry points
    call it (the trainer's ``install``, ``parse_config``): importing this module
    registers nothing."""
    for name in MODEL_ARCH:
        if name not in _extra_train_specs:
            register_train_spec(name, build_train_spec(name))
    datasets.register_datasets()
