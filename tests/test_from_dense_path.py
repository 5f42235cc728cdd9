"""A new user's from-dense path (issue 56): the docs' command for a Llama-3.2-1B folder
runs as written, at the folder's widths; a stopped conversion leaves nothing beside
``--to``; the printed continue-training command is a valid launch with the measured
schedule and a new data order.

The Llama-3.2-1B-shaped folder has the real widths (hidden 2048, 32 heads, 8 kv heads,
FFN 8192, tied embeddings, llama3 RoPE scaling), one block and a vocabulary of 1024 (no
check depends on it at TP 1; 128256 would write 0.5 GB); its weights are zeros: the
checks read shapes only, and the SVDs are not run (a block at this width takes ~40 s of
float64 SVD), the step is written without them.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
from pathlib import Path

import pytest
import torch
from helpers import REPO_ROOT
from safetensors.torch import save_file
from test_model_tokenizer import _tokenizer

from boost_titan.cli import checkpoint
from boost_titan.cli import from_dense as cli

DOCS = REPO_ROOT / "docs" / "from-dense.md"
HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 2048, 32, 8, 8192, 1024


def llama32_1b_folder(
    folder: Path, layers: int = 1, hidden: int = HIDDEN, ffn: int = FFN, heads: int = HEADS,
    random: bool = False,
) -> Path:  # fmt: skip
    """config.json as Meta's Llama-3.2-1B (widths, RoPE, tied embeddings), ``layers``
    blocks, a vocabulary of 1024, a small real tokenizer; zero (or ``random``) bf16 weights
    under transformers' names."""
    HIDDEN, FFN, HEADS = hidden, ffn, heads  # noqa: N806 (narrower models: the same layout)
    folder.mkdir(parents=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": layers,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": HIDDEN // HEADS,
        "vocab_size": VOCAB, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "max_position_embeddings": 131072, "tie_word_embeddings": True,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "torch_dtype": "bfloat16",
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    _tokenizer(folder)  # a converted model keeps its source's tokenizer: a folder has one
    kv = KV_HEADS * HIDDEN // HEADS
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,)}
    block = {
        "input_layernorm": (HIDDEN,), "post_attention_layernorm": (HIDDEN,),
        "self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (kv, HIDDEN),
        "self_attn.v_proj": (kv, HIDDEN), "self_attn.o_proj": (HIDDEN, HIDDEN),
        "mlp.gate_proj": (FFN, HIDDEN), "mlp.up_proj": (FFN, HIDDEN),
        "mlp.down_proj": (HIDDEN, FFN),
    }  # fmt: skip
    for i in range(layers):
        shapes |= {f"model.layers.{i}.{k}.weight": s for k, s in block.items()}
    make = torch.randn if random else torch.zeros
    save_file({k: make(s, dtype=torch.bfloat16) for k, s in shapes.items()},
              folder / "model.safetensors")  # fmt: skip
    return folder


def docs_command(marker: str) -> list[str]:
    """The docs' ``boost-titan`` command (continuation lines joined) holding ``marker``."""
    text = re.sub(r"\\\n\s*", " ", DOCS.read_text())
    lines = [ln.strip() for ln in text.splitlines() if marker in ln and "boost-titan" in ln]
    assert len(lines) == 1, lines
    return shlex.split(lines[0].split("  #")[0])


def test_the_docs_llama32_1b_command_runs_as_written(tmp_path, monkeypatch, capsys):
    """The rank 512 (dim 2048) was checked against the TOML's debugmodel (dim 256) and
    refused; every check is now against the folder's shapes, no --model.flavor added."""
    argv = docs_command("path/to/Llama-3.2-1B")
    assert argv[:3] == [".venv/bin/boost-titan", "checkpoint", "from-dense"]
    folder = llama32_1b_folder(tmp_path / "path/to/Llama-3.2-1B")
    out = tmp_path / "outputs/svd_l32/step-0"
    argv = [str(folder) if a == "path/to/Llama-3.2-1B" else a for a in argv[2:]]
    argv = [str(out) if a == "outputs/svd_l32/step-0" else a for a in argv]
    assert "--model.flavor" not in argv and str(out) in argv
    written = {}

    def write(folder, shapes, get):  # the SVDs at this width: ~40 s; the shapes are checked
        written.update(shapes)

    monkeypatch.setattr(cli, "write_lazily", write)
    monkeypatch.chdir(REPO_ROOT)
    with pytest.raises(SystemExit) as rc:
        checkpoint.main(argv)
    assert rc.value.code == 0, capsys.readouterr().err
    record = json.loads((out / "model_args.json").read_text())["model_args"]
    want = dict(
        arch="svd", dim=2048, n_layers=1, n_heads=32, n_kv_heads=8, ffn_dim=8192,
        vocab_size=VOCAB, rank=512, kv_rank=256, rope_theta=500000.0, rope_scaling_factor=32.0,
        rope_original_max_positions=8192, max_positions=131072,
    )  # fmt: skip
    assert {k: record[k] for k in want} == want
    assert written["layers.0.attention.wq.down.weight"] == (512, 2048)
    assert written["layers.0.attention.wk.down.weight"] == (256, 2048)
    assert written["layers.0.feed_forward.w1.up.weight"] == (8192, 512)
    assert written["output.weight"] == (VOCAB, 2048)


def test_a_rank_too_large_for_the_folder_names_its_shapes(tmp_path, monkeypatch, capsys):
    """The rank check is the config check's, at the folder's dims (2048, not the
    flavor's 256)."""
    folder = llama32_1b_folder(tmp_path / "l32")
    monkeypatch.chdir(REPO_ROOT)
    out = tmp_path / "out"
    rc = cli.main(["--job.config_file", "train_configs/debug_svd.toml", "--from", str(folder),
                   "--to", str(out), "--rank", "4096"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert rc == 1 and "\n" not in err, err
    assert "rank = 4096 is too large" in err and "(dim 2048, ffn_dim 8192)" in err, err
    assert f"at the shapes of folder {str(folder)!r}" in err and "valid: 1 .. 2048" in err
    # the TP degree too: 16 divides the folder's 32 heads (debugmodel has 8), not its 8 kv heads
    rc = cli.main(["--job.config_file", "train_configs/debug_svd.toml", "--from", str(folder),
                   "--to", str(out), "--rank", "512", "--tp", "16"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert rc == 1 and "\n" not in err and "does not divide n_kv_heads=8 (plan 'btp'" in err, err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["l32"]


# ---------------------------------------------------------------- a stopped conversion
SMALL = dict(hidden=128, ffn=256, heads=8, random=True)


@pytest.fixture
def small(tmp_path) -> tuple[Path, Path]:
    """(a small Llama-3.2-shaped folder, the --to of its conversion in a folder of its own)."""
    return llama32_1b_folder(
        tmp_path / "src" / "l32", layers=2, **SMALL
    ), tmp_path / "out" / "step-0"


def _convert(folder: Path, out: Path) -> int:
    config = "train_configs/debug_svd.toml"
    return cli.main(["--job.config_file", config, "--from", str(folder), "--to", str(out),
                     "--rank", "16", "--no-progress", "--threads", "1"])  # fmt: skip


def _stop_at_tensor(monkeypatch, n: int, stop) -> list[str]:
    """Converter.get calls ``stop()`` at its ``n``-th tensor (some files are written)."""
    from boost_titan.checkpoint.from_dense.convert import Converter

    asked, get = [], Converter.get

    def stopping(self, name):
        asked.append(name)
        if len(asked) == n:
            stop()
        return get(self, name)

    monkeypatch.setattr(Converter, "get", stopping)
    return asked


def test_an_exception_mid_conversion_leaves_nothing_beside_to(small, monkeypatch):
    folder, out = small
    monkeypatch.chdir(REPO_ROOT)

    def fail():
        assert len(list(out.parent.glob(".step-0.*.tmp/*"))) >= 2  # files were written
        raise RuntimeError("disk full")

    asked = _stop_at_tensor(monkeypatch, 6, fail)
    with pytest.raises(BaseException) as raised:  # DCP's CheckpointException (a BaseException)
        _convert(folder, out)
    assert "disk full" in repr(getattr(raised.value, "failures", raised.value))
    assert len(asked) == 6 and os.listdir(out.parent) == []


def test_sigterm_mid_conversion_removes_the_temporary_folder(small, monkeypatch, capsys):
    folder, out = small
    monkeypatch.chdir(REPO_ROOT)
    handler = signal.getsignal(signal.SIGTERM)
    _stop_at_tensor(monkeypatch, 6, lambda: os.kill(os.getpid(), signal.SIGTERM))
    assert _convert(folder, out) == 128 + signal.SIGTERM
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"boost-titan checkpoint from-dense: stopped by SIGTERM; its temporary folder beside "
        f"{out} is removed"
    )
    assert os.listdir(out.parent) == [] and signal.getsignal(signal.SIGTERM) is handler


def _killed_run_leftover(out: Path) -> Path:
    """A SIGKILLed conversion's folder: a forked child takes one and is killed in it."""
    from boost_titan.checkpoint.from_dense.scratch import scratch

    before = set(out.parent.iterdir())
    pid = os.fork()
    if pid == 0:  # the child: nothing but the folder, then SIGKILL (no finally runs)
        with scratch(out) as tmp:
            (tmp.path / "__0_0.distcp").write_bytes(b"0" * 100)
            os.kill(os.getpid(), signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    (left,) = set(out.parent.iterdir()) - before
    return left


def test_a_killed_runs_folder_is_removed_only_when_its_marker_proves_it_ours(
    small, monkeypatch, capsys
):
    import fcntl

    from boost_titan.checkpoint.from_dense.scratch import MARKER

    folder, out = small
    monkeypatch.chdir(REPO_ROOT)
    out.parent.mkdir(parents=True)
    # the same marker in folders that are not a dead conversion of this output
    alive = _killed_run_leftover(out)
    lock = os.open(alive / MARKER, os.O_RDONLY)
    fcntl.flock(lock, fcntl.LOCK_EX)  # as the live writer holds it
    other_out = _killed_run_leftover(out.parent / "step-1")
    dead = _killed_run_leftover(out)  # (its child left `alive` alone: locked)
    marker = json.loads((dead / MARKER).read_text())
    unmarked = out.parent / ".step-0.0badf00d.tmp"
    unmarked.mkdir()
    (unmarked / "notes.txt").write_text("the user's")
    other_host = out.parent / ".step-0.00c0ffee.tmp"
    other_host.mkdir()
    (other_host / MARKER).write_text(json.dumps({**marker, "host": "elsewhere"}))
    users = out.parent / ".step-0.tmp"
    users.write_text("the user's")
    try:
        assert _convert(folder, out) == 0
    finally:
        os.close(lock)
    kept = {other_out, alive, unmarked, other_host, users}
    assert set(out.parent.iterdir()) == kept | {out, out.parent / "step-0.from_dense.json"}
    assert f"removed {dead}, left by a from-dense run that was killed" in capsys.readouterr().err
    assert MARKER not in os.listdir(out) and (out / "model_args.json").is_file()


# ------------------------------------------------------------ the continue command
def test_continue_seed_differs_from_the_dense_runs():
    from boost_titan.checkpoint.from_dense.continue_training import continue_seed

    assert continue_seed(0, 0) == 1 and continue_seed(3, 3) == 4  # the dense run's: next
    assert continue_seed(5, 0) == 0  # the config's already differs
    assert continue_seed(None, 0) == 1 and continue_seed(None, 7) == 8  # not recorded


def test_the_printed_continue_command_runs_as_printed(corpus_dir, tmp_path, monkeypatch, capsys):
    """From a dense step of ours (its data position records seed 0): the printed
    command holds the measured schedule, 100 steps, a dump folder of its own and seed 1,
    and the launch check accepts it as run_train.sh passes it (NGPU=1)."""
    import pickle

    from boost_titan.checkpoint.export import write_dcp_model
    from boost_titan.models.flavors import flavors_for
    from boost_titan.models.model import Transformer
    from boost_titan.train.launch_check import parse_launch_config

    torch.manual_seed(0)
    state = Transformer(flavors_for("dense")["debugmodel"]).state_dict()
    position = {"version": 2, "samples": 800, "seq_len": 256, "seed": 0, "shuffle": True}
    src = tmp_path / "dense" / "step-200"
    write_dcp_model({**state, "dataloader": {"position": pickle.dumps(position)}}, src)
    out = tmp_path / "cola" / "step-0"
    cfg = "train_configs/debug_svd.toml"
    monkeypatch.chdir(REPO_ROOT)
    with pytest.raises(SystemExit) as rc:
        checkpoint.main(["from-dense", "--job.config_file", cfg, "--from", str(src),
                         "--to", str(out), "--no-progress", "--threads", "1"])  # fmt: skip
    assert rc.value.code == 0
    text = capsys.readouterr().out.rstrip().splitlines()
    assert "(the dense run's seed 0, recorded in its step)" in text[-2]
    env, ngpu, launcher, *flags = shlex.split(text[-1])
    assert (env, ngpu, launcher) == (f"CONFIG_FILE={cfg}", "NGPU=1", "./run_train.sh")
    want = {
        "--model.flavor": str(out), "--checkpoint.initial_load_path": str(out),
        "--job.dump_folder": f"{out}-train", "--training.steps": "100",
        "--optimizer.lr": "0.001", "--lr_scheduler.warmup_steps": "20",
        "--training.dataset_seed": "1",
    }  # fmt: skip
    assert {k: flags[flags.index(k) + 1] for k in want} == want and "--checkpoint.enable" in flags
    monkeypatch.setenv("WORLD_SIZE", "1")  # run_train.sh's check: NGPU x NNODES ranks
    config = parse_launch_config(["--job.config_file", cfg, *flags])
    assert (config.training.steps, config.training.dataset_seed) == (100, 1)
    assert (config.optimizer.lr, config.lr_scheduler.warmup_steps) == (1e-3, 20)
    assert config.checkpoint.initial_load_path == str(out) and config.checkpoint.enable


# ------------------------------------------------------------ full rank, per SVD dtype
def test_full_rank_factors_per_svd_dtype():
    """At full rank B A is W up to rounding: float64's SVD leaves only the factors' float32
    storage (3.6e-8 at every width measured, 256 to 11008 x 4096), float32's own backward
    error grows with the width (1.3e-6 at 256, 2.1e-6 at 1024, 3.7e-6 at 4096 x 4096:
    benchmarks/svd_dtype_error.py, docs/from-dense.md)."""
    from boost_titan.models.from_dense import svd_factors, weight_error

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # LAPACK's OpenMP threads spin on a shared machine
    try:
        w = torch.randn(512, 512, generator=torch.Generator().manual_seed(0)) * 0.02
        f64, f32 = (svd_factors(w, 512, dtype) for dtype in (torch.float64, torch.float32))
    finally:
        torch.set_num_threads(threads)
    assert weight_error(w, f64.down, f64.up) < 1e-7
    assert 5e-7 < weight_error(w, f32.down, f32.up) < 1e-5
