"""``boost-titan checkpoint from-dense``: a dense LLaMA -> a low-rank DCP step folder.

    boost-titan checkpoint from-dense --job.config_file train_configs/debug_cola.toml \\
        --from DENSE --to outputs/cola_from_dense/step-0 [--rank R] [--kv-rank R] [--tp N] \\
        [--fit auto|none|activations] [--calib-sequences N] [--calib-data PATH|random] \\
        [--device cpu|cuda] [--threads N]

``DENSE`` is a Hugging Face ``LlamaForCausalLM`` folder or a ``llama2`` DCP step folder
(``boost_titan.checkpoint.from_dense.source``). The config arguments (``--job.config_file``,
``--model.name``, ``--model.flavor``, ``--boost.*``) pick the architecture written
(``svd_llama2``, ``cola_llama2`` or ``lax_llama2``) and its options; its shapes are the
dense model's own, every one (``boost_titan.checkpoint.from_dense.target``), its rank
``--rank`` / ``--kv-rank`` (shorthands for ``--boost.rank`` / ``--boost.kv_rank``), else
the flavor's when the dense model has the flavor's shapes. The step records the model
(``OUT/model_args.json``): train, resume and export it with ``--model.flavor OUT`` (and
``--checkpoint.initial_load_path OUT``), no rank repeated. The last line it prints is that
training command, to run as printed: its steps, the learning rate and warm-up recommended
for a converted model, a dump folder of its own and, from one of our dense steps, another
data seed than the dense run's (``boost_titan.checkpoint.from_dense.continue_training``).

Checks come first, each failing in one line (exit 1; a bad option: exit 2) before
anything is written: a folder that is not a dense LLaMA, a rank outside [1, min(in,
out)], a tensor-parallel degree (``--tp``, default the config's) the plan cannot split
the model by (``boost_titan.tp_plans.validate_tp_degree``: heads, dims and vocabulary
under BTP, every rank as well under the vanilla plan), an existing output, ``--device
cuda`` without CUDA. Every shape those checks use is the dense model's (a folder's
config.json, a step's record; a trainer's step: the config's flavor), never the config
flavor's: no ``--model.flavor`` is needed. The step folder is written under a temporary
name beside ``OUT`` and renamed when complete; a run stopped by an exception, Ctrl-C,
SIGTERM or SIGHUP removes it, and a killed run's is removed by the next run for ``OUT``
(``boost_titan.checkpoint.from_dense.scratch``). The per-block error report is printed
and written beside it as ``OUT.from_dense.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from boost_titan.checkpoint.from_dense.continue_training import (
    continue_command,
    dense_run_seed,
    world_size,
)
from boost_titan.checkpoint.from_dense.convert import Converter, Options
from boost_titan.checkpoint.from_dense.report import Progress, tables
from boost_titan.checkpoint.from_dense.scratch import Stopped, scratch
from boost_titan.checkpoint.from_dense.source import DCPSource, DenseSource, open_source
from boost_titan.checkpoint.from_dense.stream import write_lazily
from boost_titan.checkpoint.from_dense.target import target_args, with_shapes
from boost_titan.checkpoint.model_tokenizer import for_conversion
from boost_titan.cli.args import Parser
from boost_titan.data.calibration import RANDOM, calibration_tokens
from boost_titan.models.args import LlamaArgs
from boost_titan.models.flavors import MODEL_ARCH, flavors_for
from boost_titan.models.recorded import (
    args_record,
    read_model_args,
    record_path,
    write_model_args,
)
from boost_titan.observability.peak_rss import peak_rss_gib
from boost_titan.train.config_check.model_tokenizer import tokenizer_flag

PROG = "boost-titan checkpoint from-dense"
LOW_RANK_MODELS = sorted(k for k, v in MODEL_ARCH.items() if v != "dense")
_SVD_DTYPES = {"float64": torch.float64, "float32": torch.float32}


def build_parser() -> Parser:
    p = Parser(
        prog=PROG,
        usage="%(prog)s --job.config_file CONFIG --from DENSE --to STEP [options] "
        "[--section.key VALUE ...]",
        description="Convert a dense LLaMA (Hugging Face folder or llama2 DCP step) into a "
        "low-rank model's DCP step folder. The config (--job.config_file and any --model.* / "
        "--boost.* override) defines the low-rank model, as for import.",
    )
    p.add_argument(
        "--job.config_file", dest="config_file", metavar="CONFIG",
        required=True, help="the low-rank model's training config (TOML), required",
    )  # fmt: skip
    p.add_argument(
        "--from", dest="src", metavar="DENSE", required=True, help="HF LLaMA folder or DCP step"
    )
    p.add_argument("--to", dest="dst", metavar="STEP", required=True, help="new DCP step folder")
    p.add_argument(
        "--rank", type=int, help="= --boost.rank: the factors' rank, 1 to min(in, out) of "
        "each projection (default: the flavor's)",
    )  # fmt: skip
    p.add_argument(
        "--kv-rank", type=int, help="= --boost.kv_rank: the GQA k/v projections' rank, "
        "1 to min(in, out) (default: the flavor's)",
    )  # fmt: skip
    p.add_argument(
        "--tp", type=int, help="tensor-parallel degree to check the model against "
        "(default: the config's [parallelism] tensor_parallel_degree)",
    )  # fmt: skip
    p.add_argument(
        "--fit", choices=["auto", "none", "activations"], default="auto",
        help="activations: fit each bottleneck to the dense projection's outputs on "
        "calibration tokens; auto (default): activations for cola/lax, none for svd",
    )  # fmt: skip
    p.add_argument("--fit-steps", type=int, default=20, help="L-BFGS iterations (default 20)")
    p.add_argument(
        "--calib-data", help="save_to_disk folder, .jsonl/.txt file or 'random' (default: "
        "the embedded corpus' train split)",
    )  # fmt: skip
    p.add_argument(
        "--calib-sequences", type=int, help="calibration sequences (default: 16 with a fit, "
        "else 0: no calibration, weight errors only)",
    )  # fmt: skip
    p.add_argument("--calib-seq-len", type=int, default=256, help="tokens per sequence")
    p.add_argument(
        "--heldout", type=int, help="calibration sequences kept out of the fit, for the "
        "report (default: 1 in 8, at least 1 when there are 2 or more)",
    )  # fmt: skip
    p.add_argument("--device", default="cpu", help="where SVDs and fits run: cpu, cuda[:N]")
    p.add_argument("--svd-dtype", choices=sorted(_SVD_DTYPES), default="float64",
                   help="the SVD's dtype (default float64; float32 halves its memory)")  # fmt: skip
    p.add_argument(
        "--threads", type=int, help="CPU threads (default: torch's). On a machine shared "
        "with other jobs, 1 can be far faster: OpenMP threads spin while they wait",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="calibration sample, LaX gates' G0")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def _check_options(p: argparse.ArgumentParser, o: argparse.Namespace) -> None:
    for flag, value in (("--rank", o.rank), ("--kv-rank", o.kv_rank)):
        if value is not None and value < 1:  # --boost.rank 0 means the flavor's: not here
            p.error(
                f"{flag} {value}: a rank is a positive integer, at most min(in, out) of a "
                f"projection; leave {flag} out for the flavor's"
            )
    for flag, value, low in (
        ("--tp", o.tp, 1),
        ("--fit-steps", o.fit_steps, 0), ("--calib-sequences", o.calib_sequences, 0),
        ("--calib-seq-len", o.calib_seq_len, 1), ("--heldout", o.heldout, 0),
        ("--threads", o.threads, 1),
    ):  # fmt: skip
        if value is not None and value < low:
            p.error(f"{flag} {value}: must be >= {low}")
    if o.fit == "activations" and o.calib_sequences == 0:
        p.error("--fit activations needs calibration: --calib-sequences > 0")


def _device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r}: use cpu or cuda[:N]") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"--device {name}: CUDA is not available on this machine; use --device cpu"
        )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name!r}: use cpu or cuda[:N]")
    return device


def _described(src: str) -> DenseSource | None:
    """The dense model at ``src``, opened before the config is read, when the folder
    gives its own shapes (a Hugging Face folder's config.json, a step's recorded
    model_args.json): the config's model is checked at them. None for a trainer's step,
    which records none: its shapes are the config's flavor's (:func:`_dcp_args`)."""
    folder = Path(src)
    if folder.is_dir() and not (folder / "config.json").is_file():
        record = record_path(src)
        # a low-rank record's step is refused by DCPSource (it holds factors)
        return None if record is None else DCPSource(folder, read_model_args(record))
    return open_source(src, None)  # a Hugging Face folder, or the refusal of a non-folder


def _dcp_args(flavor: str, flavor_args: LlamaArgs) -> LlamaArgs:
    """A trainer's DCP step's dense shapes: the config's flavor as llama2."""
    dense = flavors_for("dense").get(flavor)
    if dense is None:  # a flavor path: its shapes, as the dense model
        dense = replace(flavor_args, arch="dense", rank=0, kv_rank=0)
    return replace(dense, max_seq_len=flavor_args.max_seq_len)


def _config_args(job_config, dense: LlamaArgs | None) -> tuple[LlamaArgs, LlamaArgs]:
    """(the config's model after its [boost] options, at ``dense``'s shapes when given;
    the flavor as named, at its own shapes). As the config check builds it: the
    tokenizer's vocabulary is the training run's concern (its launch check), not the
    conversion's."""
    from torchtitan.protocols.train_spec import get_train_spec

    from boost_titan.train.config_check.model import _updated_args

    named = get_train_spec(job_config.model.name).model_args[job_config.model.flavor]
    return _updated_args(named if dense is None else with_shapes(named, dense), job_config), named


def check_tp(target: LlamaArgs, tp: int, plan_requested: str) -> str:
    """The plan a run at ``tp`` would use; refuses a degree it cannot split the model by."""
    from boost_titan.tp_plans import resolve_tp_plan, validate_tp_degree

    plan = resolve_tp_plan(plan_requested, target)
    if tp > 1:
        validate_tp_degree(target, tp, plan)
    return plan


@contextlib.contextmanager
def _threads(n: int | None):
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _report_path(out: Path) -> Path:
    return out.parent / f"{out.name}.from_dense.json"


def main(argv: list[str] | None = None) -> int:
    from boost_titan.checkpoint import integrity, safe_metadata

    p = build_parser()
    o, rest = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    _check_options(p, o)
    rest = ["--job.config_file", o.config_file, *rest]
    if o.rank:
        rest += ["--boost.rank", str(o.rank)]
    if o.kv_rank:
        rest += ["--boost.kv_rank", str(o.kv_rank)]
    try:
        return _run(o, rest)
    except (
        FileNotFoundError,
        FileExistsError,
        ValueError,  # SourceError, CalibrationError, HFFormatError, config errors
        safe_metadata.UntrustedCheckpointError,
        integrity.ChecksumMismatch,
    ) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    except BaseException as e:  # DCP wraps what its writes raise, Ctrl-C and SIGTERM too
        if (stop := _stop_in(e)) is not None:
            signum = getattr(stop, "signum", signal.SIGINT)
            print(
                f"{PROG}: stopped by {signal.Signals(signum).name}; its temporary folder "
                f"beside {o.dst} is removed",
                file=sys.stderr,
            )
            return 128 + signum
        if (bad := integrity.mismatch_in(e)) is None:
            raise
        print(f"{PROG}: error: {bad}", file=sys.stderr)
        return 1


def _stop_in(exc: BaseException) -> BaseException | None:
    """Ctrl-C or SIGTERM / SIGHUP (:class:`Stopped`), raised or inside DCP's
    CheckpointException (it gathers each rank's failure, BaseExceptions too)."""
    failures = [f for f, _trace in (getattr(exc, "failures", None) or {}).values()]
    return next((f for f in (exc, *failures) if isinstance(f, (KeyboardInterrupt, Stopped))), None)


def _run(o: argparse.Namespace, rest: list[str]) -> int:
    from boost_titan.train.config_check import parse_config

    t0 = time.perf_counter()
    out = Path(o.dst)
    if out.exists():
        raise FileExistsError(f"{o.dst!r} exists; from-dense writes a new checkpoint folder")
    device = _device(o.device)
    described = _described(o.src)
    shapes = None if described is None else (described.where, described.args)
    # the model only (any layout loads it), at the shapes of --from: every check of the
    # rank, the options and the TP degree is against the model written
    job_config = parse_config(rest, layout=False, shapes=shapes)
    name, flavor = job_config.model.name, job_config.model.flavor
    if MODEL_ARCH.get(name, "dense") == "dense":
        raise ValueError(
            f"[model] name {name!r}: from-dense writes a low-rank model, one of {LOW_RANK_MODELS}"
        )
    flavor_args, named = _config_args(job_config, shapes and shapes[1])
    model_desc = f"model {name!r} flavor {flavor!r}"
    source = described or open_source(o.src, _dcp_args(flavor, flavor_args))
    target = target_args(
        source.args, flavor_args, job_config.boost, source.where, model_desc, named
    )
    tp = o.tp or job_config.parallelism.tensor_parallel_degree
    plan = check_tp(target, tp, job_config.boost.tp_plan)
    ours = isinstance(source, DCPSource)  # a dense step: its run's seed, for the next run's
    dense_seed = dense_run_seed(o.src) if ours else None
    carried = for_conversion(o.src, target.vocab_size)  # the source's tokenizer, kept

    fit = o.fit == "activations" or (o.fit == "auto" and target.arch in ("cola", "lax"))
    n_seq = o.calib_sequences if o.calib_sequences is not None else (16 if fit else 0)
    if fit and n_seq == 0:
        fit = False  # --fit auto with --calib-sequences 0: no data, no fit
    held = o.heldout if o.heldout is not None else (max(1, n_seq // 8) if n_seq >= 2 else 0)
    if n_seq and held >= n_seq:
        raise ValueError(f"--heldout {held} leaves no calibration sequence of {n_seq} to fit")
    notes = []
    if target.arch == "lax" and not fit:
        notes.append(
            "LaX without the fit: the latent LayerNorm of blocks >= 1 rescales the SVD "
            "latents (activation errors above 1 are possible); --fit activations fixes it"
        )
    if target.arch == "cola" and not target.swiglu and not fit:
        notes.append(
            "this CoLA flavor drops SwiGLU's outer SiLU: without the fit the gate's "
            "bottleneck approximates W1 x, not silu(W1 x)"
        )
    for note in notes:
        print(f"note: {note}", file=sys.stderr)

    tokens = None
    with _threads(o.threads):
        if n_seq:
            tok_dir = carried.folder if carried is not None else source.tokenizer_dir
            if tok_dir is None and o.calib_data != RANDOM:
                tok_dir = Path(job_config.model.hf_assets_path)
            tokens = calibration_tokens(
                o.calib_data, tok_dir, n_seq, o.calib_seq_len, target.vocab_size, o.seed
            )
        options = Options(
            fit=fit,
            fit_steps=o.fit_steps,
            device=device,
            svd_dtype=_SVD_DTYPES[o.svd_dtype],
            seed=o.seed,
            heldout=held,
        )
        progress = Progress(7 * target.n_layers, target.n_layers, enabled=not o.no_progress)
        converter = Converter(source, target, options, tokens, progress.advance)
        out.parent.mkdir(parents=True, exist_ok=True)
        report_path = _report_path(out)
        tmp_report = report_path.parent / f".{report_path.name}.tmp"
        try:
            with scratch(out) as tmp:
                write_lazily(tmp.path, converter.shapes, converter.get)
                write_model_args(tmp.path, target)  # what later runs read: --model.flavor OUT
                if carried is not None:
                    carried.write(tmp.path)
                progress.close()
                report = {
                    "source": str(Path(o.src).resolve()),
                    "output": str(out.resolve()),
                    "model": name,
                    "flavor": flavor,
                    "model_args": args_record(target)["model_args"],
                    "arch": target.arch,
                    "rank": target.rank,
                    "kv_rank": target.effective_kv_rank,
                    "latent_act": target.activation,
                    "swiglu": target.swiglu,
                    "lax_gate": target.lax_gate if target.arch == "lax" else None,
                    "checked_tp": {"degree": tp, "plan": plan},
                    "fit": fit,
                    "fit_steps": o.fit_steps if fit else 0,
                    "svd_dtype": o.svd_dtype,
                    "device": str(device),
                    "threads": torch.get_num_threads(),
                    "notes": notes,
                    **converter.report,
                    "seconds": round(time.perf_counter() - t0, 2),
                    "peak_rss_gib": round(peak_rss_gib(), 3),
                }
                tmp_report.write_text(json.dumps(report, indent=1) + "\n")
                tmp.commit()
                os.replace(tmp_report, report_path)
        finally:
            progress.close()
            if tmp_report.exists():
                tmp_report.unlink()
    print(tables(report))
    print(
        f"wrote {out} ({name} at the dense model's shapes, rank {target.rank}, kv rank "
        f"{target.effective_kv_rank}; {'fitted' if fit else 'plain SVD'}; its model: "
        f"--model.flavor {out}) in "
        f"{report['seconds']:.1f} s, peak RSS {report['peak_rss_gib']:.2f} GiB; "
        f"report {report_path}"
    )
    lr, ngpu = job_config.optimizer.lr, world_size(job_config.parallelism)
    seed = job_config.training.dataset_seed
    command = continue_command(o.config_file, str(out), lr, ngpu, ours, dense_seed, seed)
    print(command + tokenizer_flag(out, job_config.model.hf_assets_path))
    return 0
