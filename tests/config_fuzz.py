"""Seeded fuzz of training-config values: every case must end in a run or in ONE clear
error at parse time, never in a traceback from deep inside torch/torchtitan.

Each case takes a shipped ``train_configs/*.toml``, mutates one or two keys of
``[boost]``, ``[parallelism]``, ``[training]`` (and ``[model]``, ``[optimizer]``,
``[lr_scheduler]``, ``[job] config_file``) through CLI overrides or through a modified
TOML copy (wrong types, unknown keys, missing files, a tokenizer folder without
tokenizer.json), sets ``WORLD_SIZE`` as torchrun would, and classifies the outcome:

* ``clean``    ``parse_config`` raised ValueError/FileNotFoundError, or tyro's usage
               error (SystemExit), with a message naming the mutated key;
* ``accepted`` it parsed, and the trainer's early stages (ParallelDims and the device
               mesh over a fake process group, tokenizer, dataloader, model args, the
               meta model, the TP/FSDP/PP parallelization, optimizer and LR schedule)
               built without an error;
* ``bug``      anything else: another exception type, a message that does not name the
               key, or an accepted config whose trainer construction fails.

    python -m tests.config_fuzz --seed 0 --cases 200          # print every case
    python -m tests.config_fuzz --seed 0 --cases 50 --run 2   # + 2 real 1-step runs

Import this module only in a fresh interpreter: it activates boost_titan's CPU runtime
before torchtitan is imported (``activate()`` is called by :func:`run_cases`).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

from boost_titan.train.config_file import load_config_toml

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "train_configs"

# base config -> world size of its layout
BASES = {
    "debug_cola.toml": 1,
    "debug_llama2.toml": 1,
    "debug_cola_btp_tp2.toml": 2,
    "debug_lax_pp2.toml": 2,
    "debug_svd_hsdp.toml": 4,
    "debug_cola_btp_tp2_pp2_interleaved.toml": 4,
}

_INTS_BAD = ["-1", "0", "3", "7", "1000000", "abc", "1.5", ""]
# (section, key) -> candidate CLI values (strings, as typed on a command line)
CLI_VALUES: dict[tuple[str, str], list[str]] = {
    ("boost", "tp_plan"): ["auto", "btp", "vanilla", "fullrank", "megatron", "BTP", ""],
    ("boost", "rmsnorm"): ["online", "sync", "fast"],
    ("boost", "group_linears"): ["true", "false", "maybe"],
    ("boost", "rank"): ["0", "1", "7", "32", "48", "255", "256", "257", "688", "-3", "x", "2.5"],
    ("boost", "rank_ratio"): ["0", "0.1", "0.25", "1", "1.5", "-0.5", "1e-9", "nan", "inf", "x"],
    ("boost", "kv_rank"): ["0", "16", "31", "128", "256", "257", "-1"],
    ("boost", "lax_gate"): ["kron", "dense", "diag"],
    ("boost", "latent_act"): ["default", "silu", "none", "relu"],
    ("boost", "latent_checkpoint"): ["none", "attention", "mlp", "both", "full"],
    ("boost", "latent_checkpoint_every"): ["1", "2", "5", "0", "-1"],
    ("boost", "latent_checkpoint_keep"): ["attention", "none", "all"],
    ("boost", "cpu_peak_flops"): ["0", "1e12", "-5", "nan", "inf"],
    ("boost", "nan_policy"): ["stop", "skip", "ignore"],
    ("boost", "nan_max_consecutive_skips"): ["1", "0", "-2"],
    ("parallelism", "data_parallel_replicate_degree"): ["1", "2", "0", "-1", "3"],
    ("parallelism", "data_parallel_shard_degree"): ["-1", "1", "2", "4", "0", "-2", "3"],
    ("parallelism", "tensor_parallel_degree"): ["1", "2", "3", "4", "8", "0", "-2", "16"],
    ("parallelism", "pipeline_parallel_degree"): ["1", "2", "3", "4", "0", "-1"],
    ("parallelism", "context_parallel_degree"): ["1", "2", "0"],
    ("parallelism", "expert_parallel_degree"): ["1", "2", "0"],
    ("parallelism", "pipeline_parallel_microbatch_size"): ["1", "2", "3", "0", "-1", "8"],
    ("parallelism", "pipeline_parallel_schedule"): [
        "1F1B",
        "GPipe",
        "Interleaved1F1B",
        "gpipe",
        "Bogus",
        "PipelineScheduleSingle",
    ],
    ("parallelism", "pipeline_parallel_layers_per_stage"): ["1", "2", "3", "4", "6", "0", "-1"],
    ("parallelism", "pipeline_parallel_first_stage_less_layers"): ["0", "1", "2", "-1", "7"],
    ("parallelism", "pipeline_parallel_last_stage_less_layers"): ["0", "1", "2", "-1"],
    ("parallelism", "pipeline_parallel_schedule_csv"): ["/nonexistent/schedule.csv"],
    ("parallelism", "disable_loss_parallel"): ["true", "false"],
    ("parallelism", "fsdp_reshard_after_forward"): ["default", "always", "never", "sometimes"],
    ("training", "local_batch_size"): ["1", "2", "3", "8", "0", "-4", "x"],
    ("training", "global_batch_size"): ["-1", "8", "12", "16", "6", "0", "-5"],
    ("training", "seq_len"): ["256", "64", "32", "1", "3", "30", "0", "-256", "abc", "2.5"],
    ("training", "steps"): ["1", "0", "-1", "5", "x"],
    ("training", "max_norm"): ["1.0", "0", "-1", "nan", "inf"],
    ("training", "dataset"): [
        "boost_corpus",
        "c4",
        "no_such_set",
        "local_text",
        "boost_corpus_val",
    ],
    ("training", "dataset_path"): ["/nonexistent/data", "./data/boost_corpus/train"],
    ("training", "mixed_precision_param"): ["float32", "bfloat16", "float16"],
    ("training", "dtype"): ["float32", "bfloat16", "int8"],
    ("training", "gc_freq"): ["1", "0", "-1"],
    ("training", "dataloader.num_workers"): ["0", "-1"],
    ("model", "name"): ["llama2", "cola_llama2", "lax_llama2", "svd_llama2", "gpt2", ""],
    ("model", "flavor"): ["debugmodel", "debugmodel_gqa", "9b", "DebugModel"],
    ("model", "hf_assets_path"): [
        "/nonexistent/tokenizer",
        "./data/boost_corpus",
        "./train_configs",
    ],
    ("optimizer", "name"): ["AdamW", "Adam", "SGD", "LORO"],
    ("optimizer", "lr"): ["0", "1e-3", "-1e-3", "nan"],
    ("optimizer", "beta1"): ["0.9", "1.5", "-0.1"],
    ("optimizer", "weight_decay"): ["0", "-0.1"],
    ("optimizer", "implementation"): ["fused", "foreach", "for-loop", "turbo"],
    ("lr_scheduler", "warmup_steps"): ["0", "4", "1000", "-1"],
    ("lr_scheduler", "decay_ratio"): ["0.5", "1.5", "-0.5"],
    ("lr_scheduler", "total_steps"): ["1", "5", "100", "0"],
    ("lr_scheduler", "min_lr_factor"): ["0.1", "2", "-1"],
    ("lr_scheduler", "decay_type"): ["cosine", "linear", "exp"],
    ("metrics", "log_freq"): ["1", "0", "-1"],
    ("validation", "freq"): ["1", "0"],
    ("validation", "seq_len"): ["255", "0", "128"],
    ("activation_checkpoint", "mode"): ["none", "full", "selective", "sometimes"],
    ("activation_checkpoint", "selective_ac_option"): ["op", "2", "0", "x"],
}

# (section, key) -> TOML values of a wrong type (or odd but valid)
TOML_VALUES: dict[tuple[str, str], list] = {
    ("training", "seq_len"): ["256", 256.0, 2.5, True, [256]],
    ("training", "local_batch_size"): ["4", 4.5, False],
    ("training", "steps"): ["10", 1.0],
    ("training", "max_norm"): ["1.0", 1],
    ("training", "dataset"): [42, ["boost_corpus"]],
    ("parallelism", "tensor_parallel_degree"): ["2", 2.0, True],
    ("parallelism", "data_parallel_shard_degree"): ["-1", -1.0],
    ("parallelism", "pipeline_parallel_schedule"): [1, ["1F1B"]],
    ("boost", "tp_plan"): [1, ["btp"], True],
    ("boost", "rank"): ["64", 64.0, 64.5],
    ("boost", "rank_ratio"): ["0.25", 1],
    ("boost", "group_linears"): ["yes", 1],
    ("boost", "latent_checkpoint_every"): [2.0, "2"],
    ("model", "flavor"): [1, ["debugmodel"]],
    ("model", "hf_assets_path"): [3],
    ("optimizer", "lr"): ["3e-3", [0.1]],
    ("lr_scheduler", "warmup_steps"): ["4", 4.5],
}

# odd files: kind -> description
SPECIALS = (
    "missing_config",
    "config_is_folder",
    "bad_toml",
    "tokenizer_without_json",
    "missing_tokenizer",
    "unknown_toml_key",
    "unknown_toml_section",
    "missing_corpus",
    "local_text_without_path",
    "world_size_mismatch",
    "world_size_garbage",
)


@dataclass
class Case:
    base: str
    world_size: int
    mode: str  # "cli" | "toml" | special kind
    changes: list[list] = field(default_factory=list)  # [[section, key, value], ...]

    def keys(self) -> list[str]:
        if self.mode == "unknown_toml_section":
            return [s for s, _, _ in self.changes]
        return [k.split(".")[-1] for _, k, _ in self.changes]

    def describe(self) -> str:
        ch = ", ".join(f"[{s}] {k} = {v!r}" for s, k, v in self.changes)
        return f"{self.base} WORLD_SIZE={self.world_size} {self.mode}: {ch}"


def generate(seed: int, n: int) -> list[Case]:
    rng = random.Random(seed)
    cli_keys, toml_keys = sorted(CLI_VALUES), sorted(TOML_VALUES)
    cases = []
    for _ in range(n):
        base = rng.choice(sorted(BASES))
        ws = BASES[base]
        r = rng.random()
        if r < 0.7:
            picks = rng.sample(cli_keys, rng.choice((1, 1, 2)))
            changes = [[s, k, rng.choice(CLI_VALUES[(s, k)])] for s, k in picks]
            case = Case(base, ws, "cli", changes)
            # a degree change usually comes with the launch it needs
            if (
                any(s == "parallelism" and k.endswith("degree") for s, k, _ in changes)
                and rng.random() < 0.6
            ):
                case.world_size = rng.choice((1, 2, 4, 8))
        elif r < 0.9:
            s, k = rng.choice(toml_keys)
            case = Case(base, ws, "toml", [[s, k, rng.choice(TOML_VALUES[(s, k)])]])
        else:
            case = special_case(rng.choice(SPECIALS), base, ws)
        cases.append(case)
    return cases


def special_case(kind: str, base: str, ws: int) -> Case:
    changes = {
        "missing_config": [["job", "config_file", "train_configs/no_such.toml"]],
        "config_is_folder": [["job", "config_file", "train_configs"]],
        "bad_toml": [["job", "config_file", "<broken TOML>"]],
        "tokenizer_without_json": [
            ["model", "hf_assets_path", "<folder with tokenizer_config.json only>"]
        ],
        "missing_tokenizer": [["model", "hf_assets_path", "/nonexistent/tok"]],
        "unknown_toml_key": [["training", "no_such_key", 1]],
        "unknown_toml_section": [["no_such_section", "x", 1]],
        "missing_corpus": [["training", "dataset_path", "/nonexistent/corpus"]],
        "local_text_without_path": [["training", "dataset", "local_text"]],
        "world_size_mismatch": [["parallelism", "tensor_parallel_degree", "(WORLD_SIZE 3)"]],
        "world_size_garbage": [["parallelism", "WORLD_SIZE", "two"]],
    }[kind]
    return Case(base, 3 if kind == "world_size_mismatch" else ws, kind, changes)


# ----------------------------------------------------------------------------- [fault_tolerance]
# torchft replica groups: "ft" sets the changes in a TOML copy with a live lighthouse in
# TORCHFT_LIGHTHOUSE (this process's), so what a case gets refused for is its own value;
# "ft_no_torchft" also hides torchft from the check, "ft_closed_lighthouse" points
# TORCHFT_LIGHTHOUSE at a port where nothing listens (its change: ["env", ...]).
FT_MODES = ("ft", "ft_no_torchft", "ft_closed_lighthouse")
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
_lighthouse: str | None = None  # its address


def live_lighthouse() -> str:
    """A lighthouse for the whole session, in a process of its own: one in this process
    would hold file descriptor 3, and torchtitan's ``os.path.exists(hf_assets_path)``
    takes the TOML case ``hf_assets_path = 3`` for that descriptor (AttributeError)."""
    global _lighthouse
    if _lighthouse is None:
        import atexit
        import socket
        import time

        address = closed_address()
        port = address.rsplit(":", 1)[1]
        binary = Path(sys.executable).parent / "torchft_lighthouse"
        proc = subprocess.Popen(
            [str(binary), "--min_replicas", "1", "--bind", f"127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        atexit.register(proc.kill)
        _lighthouse = address
        for _ in range(100):  # up in well under 20 s
            try:
                socket.create_connection(("127.0.0.1", int(port)), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
    return _lighthouse


def closed_address() -> str:
    import socket

    with socket.socket() as s:  # a port the OS just gave out, closed again
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@contextlib.contextmanager
def torchft_hidden(case: Case):
    """``importlib.util.find_spec("torchft")`` is None for the config check, as where
    torchft is not installed (``ft_no_torchft``)."""
    if case.mode != "ft_no_torchft":
        yield
        return
    import importlib.util
    import types

    from boost_titan.train.config_check import fault_tolerance as ft

    def find_spec(name, *args, **kwargs):
        return None if name == "torchft" else importlib.util.find_spec(name, *args, **kwargs)

    real = ft.importlib
    ft.importlib = types.SimpleNamespace(util=types.SimpleNamespace(find_spec=find_spec))
    try:
        yield
    finally:
        ft.importlib = real


# ----------------------------------------------------------------------------- running
def _toml_dump(data: dict) -> str:
    def val(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(val(x) for x in v) + "]"
        return repr(v)

    lines = []
    for section, body in data.items():
        lines.append(f"[{section}]")
        for k, v in body.items():
            if v is not None:
                lines.append(f"{k} = {val(v)}")
        lines.append("")
    return "\n".join(lines)


def build_argv(case: Case, tmp: Path) -> tuple[list[str], dict[str, str]]:
    """The CLI for a case (``--job.config_file`` first) and the environment to set."""
    base = CONFIGS / case.base
    env = {"WORLD_SIZE": str(case.world_size)}
    common = ["--job.dump_folder", str(tmp / "dump")]
    if case.mode == "cli":
        argv = ["--job.config_file", str(base), *common]
        for s, k, v in case.changes:
            argv += [f"--{s}.{k}", v]
        return argv, env
    data = load_config_toml(str(base))  # `extends` resolved: the copy stands alone
    path = tmp / f"case_{abs(hash(case.describe())) % 10**8}.toml"
    if case.mode == "toml" or case.mode in ("unknown_toml_key", "unknown_toml_section"):
        for s, k, v in case.changes:
            data.setdefault(s, {})[k] = v
    elif case.mode in FT_MODES:
        for s, k, v in case.changes:
            if s != "env":
                data.setdefault(s, {})[k] = v
        env[LIGHTHOUSE_ENV] = (
            closed_address() if case.mode == "ft_closed_lighthouse" else live_lighthouse()
        )
    elif case.mode == "missing_config":
        return ["--job.config_file", str(tmp / "no_such.toml"), *common], env
    elif case.mode == "config_is_folder":
        return ["--job.config_file", str(CONFIGS), *common], env
    elif case.mode == "bad_toml":
        path.write_text(base.read_text() + "\n[training\nseq_len = \n")
        return ["--job.config_file", str(path), *common], env
    elif case.mode == "tokenizer_without_json":
        tok = tmp / "tok_nojson"
        tok.mkdir(exist_ok=True)
        shutil.copy(REPO / "data/boost_corpus/tokenizer/tokenizer_config.json", tok)
        data["model"]["hf_assets_path"] = str(tok)
    elif case.mode == "missing_tokenizer":
        data["model"]["hf_assets_path"] = "/nonexistent/tok"
    elif case.mode == "missing_corpus":
        data["training"]["dataset_path"] = "/nonexistent/corpus"
    elif case.mode == "local_text_without_path":
        data["training"]["dataset"] = "local_text"
        data["training"].pop("dataset_path", None)
    elif case.mode == "world_size_mismatch":
        pass
    elif case.mode == "world_size_garbage":
        env["WORLD_SIZE"] = "two"
    path.write_text(_toml_dump(data))
    return ["--job.config_file", str(path), *common], env


@dataclass
class Outcome:
    case: Case
    category: str  # clean | accepted | bug
    detail: str

    def line(self) -> str:
        return f"{self.category:8s} {self.case.describe()}\n         -> {self.detail}"


def _names_key(text: str, case: Case) -> bool:
    if case.mode in ("world_size_mismatch", "world_size_garbage") or case.world_size != BASES.get(
        case.base, case.world_size
    ):
        if "WORLD_SIZE" in text:
            return True
    for key in case.keys():
        if key in text or key.replace("_", "-") in text:
            return True
    return False


def _deep_frame(tb) -> str | None:
    """The innermost frame, if it lies in torch or in torchtitan's runtime (not its
    config parser): a traceback from deep inside."""
    frames = traceback.extract_tb(tb)
    if not frames:
        return None
    last = frames[-1]
    f = last.filename.replace(os.sep, "/")
    if "/torchtitan/config/" in f or "/boost_titan/" in f or "/tyro/" in f:
        return None
    if "site-packages/torch" in f:
        return f"{f}:{last.lineno} {last.name}"
    return None


def classify_error(case: Case, exc: BaseException, captured: str) -> Outcome:
    if isinstance(exc, SystemExit):
        text = captured
        ok = exc.code not in (0, None) and _names_key(text, case)
        detail = (
            f"SystemExit({exc.code}) "
            + " ".join(
                ln.strip()
                for ln in text.splitlines()
                if ln.strip() and not ln.strip().startswith("│ ")
            )[-300:]
        )
        return Outcome(case, "clean" if ok else "bug", detail)
    msg = f"{type(exc).__name__}: {exc}"
    deep = _deep_frame(exc.__traceback__)
    if isinstance(exc, (ValueError, FileNotFoundError)) and _names_key(str(exc), case) and not deep:
        return Outcome(case, "clean", msg[:1000])
    why = (
        f"raised in {deep}"
        if deep
        else (
            "message does not name the key"
            if isinstance(exc, (ValueError, FileNotFoundError))
            else "unexpected exception type"
        )
    )
    return Outcome(case, "bug", f"{why}: {msg[:400]}")


def early_stages(config, world_size: int) -> None:
    """The trainer's construction up to (not including) weight allocation, over a fake
    process group of ``world_size`` ranks: whatever fails here fails in a real run."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchtitan.components.lr_scheduler import build_lr_schedulers
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols import train_spec as ts

    p = config.parallelism
    dims = ParallelDims(
        dp_shard=p.data_parallel_shard_degree,
        dp_replicate=p.data_parallel_replicate_degree,
        cp=p.context_parallel_degree,
        tp=p.tensor_parallel_degree,
        pp=p.pipeline_parallel_degree,
        ep=p.expert_parallel_degree,
        etp=p.expert_tensor_parallel_degree,
        world_size=world_size,
    )
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        dims.build_mesh()
        batch_degree = dims.get_mesh("batch").size() if dims.dp_enabled else 1
        spec = ts.get_train_spec(config.model.name)
        tokenizer = spec.build_tokenizer_fn(config)
        spec.build_dataloader_fn(
            dp_world_size=batch_degree, dp_rank=0, tokenizer=tokenizer, job_config=config
        )
        model_args = copy.deepcopy(spec.model_args[config.model.flavor])
        model_args.update_from_config(config)
        with torch.device("meta"):
            model = spec.model_cls(model_args)
        model_args.get_nparams_and_flops(model, config.training.seq_len)
        loss_fn = spec.build_loss_fn(config, parallel_dims=dims)
        t = config.training
        gbs = t.global_batch_size if t.global_batch_size >= 0 else t.local_batch_size * batch_degree
        assert gbs > 0 and gbs % (t.local_batch_size * batch_degree) == 0, "global batch size"
        if dims.pp_enabled:
            spec.pipelining_fn(
                model, dims, config, torch.device("cpu"), model_args, spec.parallelize_fn, loss_fn
            )
        else:
            spec.parallelize_fn(model, dims, config)
        # the spec's builder on the (meta) model: LORO finds its factor pairs here
        optimizers = spec.build_optimizers_fn([model], config.optimizer, dims)
        schedulers = build_lr_schedulers(optimizers, config.lr_scheduler, t.steps)
        for _ in range(min(t.steps, 2000)):  # the LR factor of every training step
            schedulers.step()
            lr = schedulers.schedulers[0].get_last_lr()[0]
            assert lr >= 0, (
                f"negative learning rate {lr} at step {schedulers.schedulers[0].last_epoch}"
            )
        if config.validation.enable:
            from torchtitan.hf_datasets.text_datasets import build_text_validation_dataloader

            build_text_validation_dataloader(
                dp_world_size=batch_degree, dp_rank=0, tokenizer=tokenizer, job_config=config
            )
    finally:
        dist.destroy_process_group()


def run_case(case: Case, tmp: Path, deep: bool = True) -> Outcome:
    from boost_titan.train.config_check import parse_config

    argv, env = build_argv(case, tmp)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    captured = io.StringIO()
    try:
        try:
            with (
                contextlib.redirect_stderr(captured),
                contextlib.redirect_stdout(captured),
                torchft_hidden(case),
            ):
                config = parse_config(argv)
        except BaseException as e:  # noqa: BLE001  (tyro exits with SystemExit)
            if isinstance(e, KeyboardInterrupt):
                raise
            return classify_error(case, e, captured.getvalue())
        if not deep:
            return Outcome(case, "accepted", "parsed")
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                early_stages(config, case.world_size)
        except Exception as e:  # noqa: BLE001
            frames = traceback.extract_tb(e.__traceback__)
            where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
            return Outcome(
                case,
                "bug",
                f"accepted at parse time, trainer construction failed at "
                f"{where}: {type(e).__name__}: {str(e)[:300]}",
            )
        return Outcome(case, "accepted", "parsed; trainer's early stages built")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_cases(cases: list[Case], deep: bool = True, verbose: bool = False) -> list[Outcome]:
    from boost_titan.parallel import cpu_runtime

    cpu_runtime.activate()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # as run_train.sh launches
    import logging

    logging.getLogger().setLevel(logging.ERROR)  # torchtitan's info/warning lines
    from torchtitan.tools import logging as tt_logging

    tt_logging.logger.setLevel(logging.ERROR)
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="config_fuzz_") as d:
        for case in cases:
            out = run_case(case, Path(d), deep=deep)
            outcomes.append(out)
            if verbose:
                print(out.line(), flush=True)
    return outcomes


def run_for_real(case: Case, tmp: Path, timeout: int = 600) -> tuple[bool, str]:
    """A 1-step run of an accepted case through run_train.sh (NGPU = its WORLD_SIZE)."""
    argv, _ = build_argv(case, tmp)
    config_file = argv[1]
    rest = argv[2:] + [
        "--training.steps",
        "1",
        "--validation.no-enable",
        "--checkpoint.no-enable",
        "--metrics.no-enable-tensorboard",
    ]
    env = dict(
        os.environ,
        NGPU=str(case.world_size),
        CONFIG_FILE=config_file,
        PYTHON=sys.executable,
        LOG_RANK=",".join(map(str, range(case.world_size))),
    )
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(
        [str(REPO / "run_train.sh"), *rest],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    out = proc.stdout + proc.stderr
    return proc.returncode == 0 and re.search(r"step:\s*1\s+loss", out) is not None, out


def summarize(outcomes: list[Outcome]) -> dict[str, int]:
    stats = {"cases": len(outcomes), "clean": 0, "accepted": 0, "bug": 0}
    for o in outcomes:
        stats[o.category] += 1
    return stats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tests.config_fuzz", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cases", type=int, default=100)
    ap.add_argument(
        "--no-deep", action="store_true", help="parse only (skip the trainer's early stages)"
    )
    ap.add_argument(
        "--run",
        type=int,
        default=0,
        metavar="K",
        help="also run K accepted cases for real (1 step through run_train.sh)",
    )
    ap.add_argument("--json", help="write the outcomes here")
    args = ap.parse_args(argv)
    cases = generate(args.seed, args.cases)
    outcomes = run_cases(cases, deep=not args.no_deep, verbose=True)
    stats = summarize(outcomes)
    if args.run:
        accepted = [o.case for o in outcomes if o.category == "accepted"]
        rng = random.Random(args.seed)
        with tempfile.TemporaryDirectory(prefix="config_fuzz_run_") as d:
            for case in rng.sample(accepted, min(args.run, len(accepted))):
                ok, out = run_for_real(case, Path(d))
                print(f"{'ran' if ok else 'RUN FAILED':10s} {case.describe()}", flush=True)
                if not ok:
                    stats["bug"] += 1
                    print(out[-3000:])
    print(json.dumps(stats))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                [{**asdict(o.case), "category": o.category, "detail": o.detail} for o in outcomes],
                indent=1,
            )
        )
    return 1 if stats["bug"] else 0


if __name__ == "__main__":
    sys.exit(main())
