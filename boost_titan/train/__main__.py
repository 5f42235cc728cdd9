"""``torchrun ... -m boost_titan.train --job.config_file X.toml``: the training entry
(:func:`boost_titan.train.trainer.main`; ``run_train.sh`` launches it)."""

import os

# torchft (imported with torchtitan) reads RUST_LOG once, at import: its Rust side logs
# six INFO lines per step per rank; warnings and errors stay (a RUST_LOG of yours is kept)
os.environ.setdefault("RUST_LOG", "warn")

from boost_titan.parallel import cpu_runtime

cpu_runtime.activate()  # before torchtitan is imported: it fixes device_type at import

from boost_titan.train import trainer  # noqa: E402

trainer.main()
if cpu_runtime.is_active():  # gloo's threads must not meet interpreter shutdown
    cpu_runtime.exit_after_clean_shutdown()
