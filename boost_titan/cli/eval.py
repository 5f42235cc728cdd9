"""Evaluate an exported Hugging Face folder with lm-eval, offline: a thin wrapper.

    .venv/bin/boost-titan eval --model outputs/hf/debug_cola [--limit 20]
        [--data my_heldout.jsonl --text-field content] [--tasks T1,T2] [--output FILE]

is ``lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True --tasks
boost_corpus_ppl --include_path boost_titan/cli/tasks`` plus three things: the
perplexity task's data is the embedded corpus's validation split where training finds
it (``$BOOST_TITAN_DATA``, else ``./data/boost_corpus``), ``--data`` scores your own
held-out documents with the same task, and the byte perplexity is converted to what
training logs:

    nats per token = ln(byte_perplexity) * bytes / tokens

(lm-eval sums each document's negative log-likelihood over its tokens and divides by its
UTF-8 bytes; ``bytes`` and ``tokens`` are those of the scored documents under the folder's
tokenizer). Training's validation loss is the same quantity on the same documents, but
packed across document boundaries into ``seq_len`` windows with BOS/EOS between
documents, so the two agree closely but not exactly (docs/huggingface.md: 7.55224 vs
7.5533 on the debug model).

Nothing is downloaded: ``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` are set unless you set
them yourself; a task that needs the Hub (hellaswag, ...) then fails in lm-eval with its
own message.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from boost_titan.config import Parser, refuse
from boost_titan.data.corpus.manifest import default_corpus_dir

TASKS_DIR = Path(__file__).resolve().parent / "tasks"  # package data: ships in the wheel
PPL_TASK = "boost_corpus_ppl"
_DATA_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}


PROG = "boost-titan eval"


class EvalError(SystemExit):
    """A bad model folder, data file or task: :func:`main` prints it as one refusal line,
    exit status 2 (a SystemExit whose code is 2 prints nothing by itself)."""

    def __init__(self, msg: str):
        super().__init__(msg)
        self.code = 2


def ppl_task(data: str | None = None, text_field: str = "text") -> dict[str, Any]:
    """The perplexity task as lm-eval's config dict, its data path made absolute
    (``data``: your own documents instead of the embedded validation split)."""
    import yaml

    config = yaml.safe_load((TASKS_DIR / f"{PPL_TASK}.yaml").read_text())
    if data is None:
        # the task file names the split relative to the repository root, as training's
        # default corpus folder is relative to the working directory
        relative = Path(config["dataset_kwargs"]["data_files"]["test"])
        path = default_corpus_dir() / relative.relative_to("data/boost_corpus")
        if not path.is_file():
            raise EvalError(
                f"the validation split {str(path)!r} is missing: build the corpus with "
                "`.venv/bin/boost-titan data build` (make data)"
            )
        config["dataset_kwargs"]["data_files"]["test"] = str(path)
        return config
    path = Path(data)
    kind = _DATA_FORMATS.get(path.suffix)
    if not path.is_file() or kind is None:
        raise EvalError(
            f"--data {data!r} must be an existing file of {sorted(_DATA_FORMATS)} "
            f"({'not a file' if not path.is_file() else f'suffix {path.suffix!r}'})"
        )
    config.update(
        task=f"{PPL_TASK}_{path.stem}",
        dataset_path=kind,
        dataset_kwargs={"data_files": {"test": str(path.resolve())}},
        doc_to_target="{{" + text_field + "}}",
    )
    return config


def documents(task: dict[str, Any], text_field: str, limit: int | None) -> list[str]:
    """The documents lm-eval scores (its ``--limit`` takes the first ones)."""
    from datasets import load_dataset

    ds = load_dataset(task["dataset_path"], split="test", **task["dataset_kwargs"])
    if text_field not in ds.column_names:
        raise EvalError(
            f"--text-field {text_field!r} is not a field of {task['dataset_kwargs']}; "
            f"fields: {ds.column_names}"
        )
    n = len(ds) if limit is None else min(limit, len(ds))
    return [ds[i][text_field] for i in range(n)]


def nats_per_token(byte_perplexity: float, docs: list[str], tokenizer) -> dict[str, float]:
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    n_tokens = sum(len(tokenizer(d, add_special_tokens=False)["input_ids"]) for d in docs)
    return {
        "documents": len(docs),
        "bytes": n_bytes,
        "tokens": n_tokens,
        "nats_per_token": math.log(byte_perplexity) * n_bytes / n_tokens,
    }


def _check_model_dir(model: str) -> None:
    missing = [f for f in ("config.json", "tokenizer.json") if not (Path(model) / f).is_file()]
    if missing:
        raise EvalError(
            f"--model {model!r} is not a Hugging Face folder (no {', '.join(missing)}); "
            "export one with `.venv/bin/boost-titan checkpoint export --format hf`"
        )


def quiet() -> None:
    """Progress bars and informational logging off (lm-eval's, ``datasets``',
    ``transformers``' and ``huggingface_hub``'s, tqdm's; transformers' "Token indices sequence
    length is longer than ..." warning: lm-eval windows long documents itself): what is left
    is the result and any error. Environment variables first (read when each library is
    imported), then the libraries' own switches for those already imported."""
    import logging

    for var, value in (
        ("TQDM_DISABLE", "1"),  # tqdm >= 4.66 takes its defaults from TQDM_* variables
        ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
        ("HF_DATASETS_DISABLE_PROGRESS_BARS", "1"),
        ("TRANSFORMERS_VERBOSITY", "error"),
        ("DATASETS_VERBOSITY", "error"),
        ("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1"),
    ):
        os.environ.setdefault(var, value)
    for name in ("lm_eval", "lm-eval", "datasets", "transformers", "huggingface_hub"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import tqdm

    # lm-eval passes its bars an explicit ``disable=`` (which TQDM_DISABLE does not
    # override) and opens one per document's rolling windows: every bar is off here
    if not getattr(tqdm.std.tqdm.__init__, "_boost_quiet", False):
        init = tqdm.std.tqdm.__init__

        def disabled(self, *args, **kwargs):
            kwargs["disable"] = True
            init(self, *args, **kwargs)

        disabled._boost_quiet = True
        tqdm.std.tqdm.__init__ = disabled
    import datasets
    import transformers

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def evaluate(
    model: str,
    tasks: list[str | dict[str, Any]],
    limit: int | None = None,
    batch_size: int = 1,
    device: str | None = None,
    dtype: str = "float32",
) -> dict[str, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import lm_eval
    import torch
    from lm_eval.tasks import TaskManager

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return lm_eval.simple_evaluate(
        model="hf",
        model_args={"pretrained": model, "trust_remote_code": True, "dtype": dtype},
        tasks=tasks,
        task_manager=TaskManager(include_path=str(TASKS_DIR)),
        limit=limit,
        batch_size=batch_size,
        device=device,
        log_samples=False,
    )


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except EvalError as e:
        refuse(PROG, e.args[0])


def _main(argv: list[str] | None) -> int:
    p = Parser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="an exported Hugging Face folder")
    p.add_argument("--tasks", default=PPL_TASK, help=f"comma-separated (default {PPL_TASK})")
    p.add_argument("--data", help="score these documents (.jsonl/.json/.parquet/.arrow) instead")
    p.add_argument(
        "--text-field",
        default="text",
        help="with --data: the field holding each document's text (default %(default)s)",
    )
    p.add_argument("--limit", type=int, help="only the first N documents of each task")
    p.add_argument("--batch-size", type=int, default=1, help="documents scored at once (default 1)")
    p.add_argument("--device", help="default: cuda when available, else cpu")
    p.add_argument(
        "--dtype",
        default="float32",
        help="the dtype lm-eval loads the model in: float32 (default), bfloat16, float16, auto",
    )
    p.add_argument("--output", help="write lm-eval's results (and the conversion) as JSON")
    p.add_argument(
        "--verbose", action="store_true", help="keep lm-eval's, datasets' and transformers' "
        "logging and progress bars (default: the result and errors only)",
    )  # fmt: skip
    a = p.parse_args(argv)
    _check_model_dir(a.model)
    if not a.verbose:
        quiet()

    tasks: list[str | dict[str, Any]] = []
    ppl = None
    for name in a.tasks.split(","):
        if name == PPL_TASK:
            ppl = ppl_task(a.data, a.text_field)
            tasks.append(ppl)
        elif a.data:
            raise EvalError(f"--data scores the {PPL_TASK} task only; --tasks has {name!r}")
        else:
            tasks.append(name)
    out = evaluate(a.model, tasks, a.limit, a.batch_size, a.device, a.dtype)
    if out is None:  # lm-eval returns None on non-zero ranks only
        return 0
    from lm_eval.utils import make_table

    print(make_table(out))
    summary: dict[str, Any] = {"results": out["results"]}
    if ppl is not None:
        from transformers import AutoTokenizer

        metrics = out["results"][ppl["task"]]
        docs = documents(ppl, a.text_field if a.data else "text", a.limit)
        conv = nats_per_token(
            metrics["byte_perplexity,none"],
            docs,
            AutoTokenizer.from_pretrained(a.model, trust_remote_code=True),
        )
        summary["conversion"] = conv
        print(
            f"{ppl['task']}: {conv['documents']} documents, {conv['bytes']} bytes, "
            f"{conv['tokens']} tokens: {conv['nats_per_token']:.5f} nats/token "
            "(= ln(byte_perplexity) * bytes / tokens; compare with the validation loss)"
        )
    if a.output:
        Path(a.output).parent.mkdir(parents=True, exist_ok=True)
        Path(a.output).write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return 0
