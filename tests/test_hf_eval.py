"""lm-eval on an exported folder, offline (``boost-titan eval``): the perplexity
task's figures equal what the trainer's own model computes on the same documents.

The reference is independent of lm-eval and of the exported ``transformers`` class: the
trainer's ``Transformer`` scores each document with the windows lm-eval's rolling
log-likelihood uses (``max_length`` tokens per window, one token of context between
windows, BOS before the first, a short last window filled with earlier context), and the
perplexities follow from their definitions: byte = exp(NLL / UTF-8 bytes), word =
exp(NLL / whitespace-separated words).
"""

from __future__ import annotations

import json
import math
import re

import torch
from helpers import run_main
from test_hf_export import _ours

from boost_titan.checkpoint.hf.folder import write_hf_folder
from boost_titan.cli import eval as boost_eval

LIMIT = 3


def _rolling_nll(model, ids: list[int], bos: int, max_len: int) -> float:
    """Sum of -log p(token) over every token of one document, window by window: each
    window predicts the next ``max_len`` tokens (the last one fewer) from ``max_len``
    inputs, i.e. one token of context, BOS for the first; the last window, when shorter,
    keeps ``max_len`` inputs by taking more context from before it."""
    stream = [bos, *ids]  # stream[i] is the input that predicts ids[i]
    total = 0.0
    for start in range(0, len(ids), max_len):
        end = min(start + max_len, len(ids))
        first_input = max(0, end - max_len)
        inputs = stream[first_input:end]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([inputs])).float(), dim=-1)[0]
        predicted = logp[start - first_input :]
        total -= predicted.gather(1, torch.tensor(ids[start:end])[:, None]).sum().item()
    return total


def test_lm_eval_perplexity_equals_the_trainers_model(tmp_path, corpus_dir):
    from transformers import AutoTokenizer

    model = _ours("cola", "debugmodel_gqa", "kron")  # max_seq_len 64: several windows per doc
    folder = write_hf_folder(
        model.state_dict(), model.model_args, "boost", corpus_dir / "tokenizer", tmp_path / "hf"
    )
    # the validation split's first documents, cut to ~2000 characters (a few hundred
    # tokens: short and long last windows), under another field name: --data's path
    docs = [
        d[: 1500 + 250 * i]
        for i, d in enumerate(boost_eval.documents(boost_eval.ppl_task(), "text", LIMIT))
    ]
    data = tmp_path / "held_out.jsonl"
    data.write_text("".join(json.dumps({"content": d}) + "\n" for d in docs))
    out = tmp_path / "eval.json"
    # the README's command (docs/huggingface.md), on your own documents
    proc = run_main(
        "boost_titan.cli.main", "eval", "--model", str(folder), "--data", str(data),
        "--text-field", "content", "--output", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "nats/token" in proc.stdout and "byte_perplexity" in proc.stdout
    # the wrapper trusts the folder's code (it asked for it): transformers never prompts
    assert "Do you wish to run the custom code" not in proc.stdout + proc.stderr
    # the result and little else: no progress bars (lm-eval opens one per document), no
    # "Token indices sequence length" warnings, no informational logging
    lines = (proc.stdout + proc.stderr).splitlines()
    assert len(lines) < 20, "\n".join(lines[:40])
    assert "Token indices sequence length" not in proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    metrics = result["results"]["boost_corpus_ppl_held_out"]

    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    max_len = model.model_args.max_seq_len
    ids = [tok(d, add_special_tokens=False)["input_ids"] for d in docs]
    nll = sum(_rolling_nll(model, i, tok.bos_token_id, max_len) for i in ids)
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    n_words = sum(len(re.split(r"\s+", d)) for d in docs)
    n_tokens = sum(map(len, ids))
    assert all(len(i) > 4 * max_len and len(i) % max_len for i in ids)  # windows, short last

    assert math.isclose(metrics["byte_perplexity,none"], math.exp(nll / n_bytes), rel_tol=1e-5)
    assert math.isclose(metrics["word_perplexity,none"], math.exp(nll / n_words), rel_tol=1e-5)
    assert math.isclose(metrics["bits_per_byte,none"], nll / n_bytes / math.log(2), rel_tol=1e-5)
    conv = result["conversion"]
    assert (conv["documents"], conv["bytes"], conv["tokens"]) == (len(docs), n_bytes, n_tokens)
    assert math.isclose(conv["nats_per_token"], nll / n_tokens, rel_tol=1e-5)


def test_bad_model_folder_and_data_are_one_line(tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit) as e:
        boost_eval.main(["--model", str(tmp_path)])
    assert e.value.code == 2  # the line printed (an EvalError of code 2 alone prints nothing)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"boost-titan eval: error: --model {str(tmp_path)!r} is not a Hugging Face folder "
        "(no config.json"
    ), err
    with pytest.raises(SystemExit, match=r"--data .*must be an existing file.*suffix '.csv'"):
        (tmp_path / "x.csv").write_text("a\n")
        boost_eval.ppl_task(str(tmp_path / "x.csv"))
