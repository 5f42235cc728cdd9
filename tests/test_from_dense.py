"""``boost-titan checkpoint from-dense``: a dense LLaMA -> a low-rank DCP step.

In one process (the library, small shapes):

* at full rank (r = min(in, out); k/v 128 under GQA) the converted SVD model computes the
  dense model's logits to 1e-5 relative, MHA and GQA, through the streamed DCP folder;
  its factors are balanced (B^T B = A A^T);
* at r < d every projection's relative Frobenius error is the Eckart-Young tail of its
  singular values (torch.linalg.svdvals), to 1e-6;
* LaX: every crossing gate contributes exactly zero at step 0 and still gets gradients.

Through the command line (forked from the test launcher's server) and the trainer:

* a transformers ``LlamaForCausalLM`` folder (random weights, debugmodel shapes)
  converts to CoLA with the activation-aware fit, whose activation error is below plain
  SVD's on the calibration tokens and on held-out ones; the step folder verifies and
  trains 2 steps in one process and under BTP TP2 (2 gloo ranks) with the same first loss;
* a llama2 DCP step converts to SVD and trains 2 steps with LORO through an exact step;
* bad inputs fail in one line (exit 1, 2 for a bad option) with nothing written.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import REPO_ROOT, assert_safe_metadata, run_main, run_training

from boost_titan.checkpoint.from_dense.continue_training import (
    CONTINUE_STEPS,
    CONTINUE_WARMUP,
    continue_lr,
)
from boost_titan.checkpoint.from_dense.convert import Converter, Options, projection_path
from boost_titan.checkpoint.from_dense.source import StateDictSource
from boost_titan.checkpoint.from_dense.stream import write_lazily
from boost_titan.cli import from_dense as cli
from boost_titan.models.flavors import flavors_for
from boost_titan.models.model import PROJ_ORDER, Transformer

CONFIGS = REPO_ROOT / "train_configs"
SEQ = 64
COMMON = ("--checkpoint.enable", "--validation.no-enable", "--metrics.no-enable-tensorboard")
TWO_STEPS = ("--training.steps", "2", "--training.mixed_precision_param", "float32")


@pytest.fixture(autouse=True)
def one_thread():
    """One CPU thread for the SVDs: on a 2-core machine shared with other jobs, OpenMP's
    spinning threads made the debug model's small SVDs ~50x slower with two."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def dense_model(flavor: str, seed: int = 0) -> Transformer:
    args = replace(flavors_for("dense")[flavor], max_seq_len=SEQ)
    torch.manual_seed(seed)
    m = Transformer(args)
    with torch.no_grad():
        m.init_weights()
        for n, p in m.named_parameters():
            if "norm" in n:  # norms off 1, so a lost norm shows
                p.normal_(1.0, 0.1)
            if ".wq." in n or ".wk." in n:
                p.mul_(8.0)  # sharp attention, so a q/k row order mix-up shows
    return m.eval()


def tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(3))


def converted(dense: Transformer, target, tmp: Path, **options) -> Transformer:
    """``dense`` converted to ``target`` through the streamed DCP folder, loaded back."""
    import torch.distributed.checkpoint as dcp

    conv = Converter(
        StateDictSource(dense.model_args, dense.state_dict()), target, Options(**options)
    )
    write_lazily(tmp, conv.shapes, conv.get)
    assert not conv.ready  # every tensor handed out once, nothing left behind
    # one file per tensor: DCP holds a file's tensors until it closes it (memory)
    assert len(list(tmp.glob("*.distcp"))) == len(conv.shapes)
    m = Transformer(target)
    state = {k: torch.zeros(v.shape) for k, v in m.state_dict().items()}
    with warnings.catch_warnings():  # one process, no process group: the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(tmp), no_dist=True)
    m.load_state_dict(state, strict=True)
    m.freqs_cis = m._precompute_freqs_cis()
    m.report = conv.report
    return m.eval()


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_gqa"])
def test_full_rank_svd_computes_the_dense_logits(flavor, tmp_path):
    dense = dense_model(flavor)
    a = dense.model_args
    kv = a.kv_dim  # 256 (MHA) or 128 (GQA): min(in, out) of k and v
    # the dense norm eps, to compare the factorisation alone (svd_llama2's flavors use 1e-6)
    target = replace(flavors_for("svd")[flavor], max_seq_len=SEQ, rank=a.dim, kv_rank=kv,
                     norm_eps=a.norm_eps)  # fmt: skip
    low = converted(dense, target, tmp_path / "step-0")
    with torch.no_grad():
        want, got = dense(tokens(a.vocab_size)), low(tokens(a.vocab_size))
    rel = float((got - want).norm() / want.norm())
    print(f"\n{flavor}: full-rank SVD logits vs dense, relative error {rel:.2e}")
    assert rel < 1e-5
    for i in range(a.n_layers):
        for p in low.layers[str(i)].projections():
            A, B = p.down.weight.detach().double(), p.up.weight.detach().double()
            ata, bb = A @ A.t(), B.t() @ B  # balanced: both the diagonal of kept s_i
            torch.testing.assert_close(ata, bb, rtol=1e-5, atol=1e-5 * float(ata.diag().max()))
            off = ata - torch.diag(ata.diag())
            assert float(off.abs().max()) < 1e-4 * float(ata.diag().max())


def test_truncated_svd_error_is_the_eckart_young_tail(tmp_path):
    dense = dense_model("debugmodel_gqa", seed=1)
    r, rkv = 40, 24
    target = replace(flavors_for("svd")["debugmodel_gqa"], max_seq_len=SEQ, rank=r, kv_rank=rkv)
    low = converted(dense, target, tmp_path / "step-0")
    checked = 0
    for i in range(target.n_layers):
        row = low.report["layers"][i]["projections"]
        for name, p in zip(PROJ_ORDER, low.layers[str(i)].projections()):
            w = dense.state_dict()[f"layers.{i}.{projection_path(name)}.weight"].double()
            s = torch.linalg.svdvals(w)
            rank = rkv if name in ("wk", "wv") else r
            tail = math.sqrt(float(s[rank:].pow(2).sum())) / float(w.norm())
            ab = p.up.weight.detach().double() @ p.down.weight.detach().double()
            ours = float((w - ab).norm() / w.norm())
            assert abs(ours - tail) < 1e-6, (i, name, ours, tail)
            assert abs(row[name]["svd_rel_err"] - tail) < 1e-6, (i, name)
            assert abs(row[name]["eckart_young_tail"] - tail) < 1e-9, (i, name)
            assert 0.05 < tail < 0.95  # a real truncation
            checked += 1
    assert checked == 7 * target.n_layers


@pytest.mark.parametrize("gate", ["kron", "dense"])
def test_lax_gates_contribute_zero_and_learn(gate, tmp_path):
    dense = dense_model("debugmodel")
    target = replace(flavors_for("lax")["debugmodel"], max_seq_len=SEQ, rank=16, lax_gate=gate)
    low = converted(dense, target, tmp_path / "step-0")
    gates = [p.cross.gate for i in range(1, 4) for p in low.layers[str(i)].projections()]
    assert len(gates) == 21
    for g in gates:
        if gate == "kron":
            assert torch.count_nonzero(g.g1) == 0 and torch.count_nonzero(g.g0) == g.g0.numel()
        else:
            assert torch.count_nonzero(g.weight) == 0
        h = torch.randn(3, 16)
        assert torch.count_nonzero(g(h)) == 0  # exactly no crossing at step 0
    low.train()
    low(tokens(target.vocab_size)).logsumexp(-1).mean().backward()
    first = gates[0].g1 if gate == "kron" else gates[0].weight
    assert first.grad is not None and float(first.grad.abs().max()) > 0  # it can learn


# ----------------------------------------------------------------------------- the CLI
def _from_dense(*args: str, config: str, expect_rc: int = 0):
    proc = run_main(
        "boost_titan.cli.main", "checkpoint", "from-dense", "--job.config_file",
        str(CONFIGS / config),
        "--threads", "1", "--no-progress", *args,
    )  # fmt: skip
    assert proc.returncode == expect_rc, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def hf_llama(corpus_dir, tmp_path_factory) -> Path:
    """A transformers LlamaForCausalLM folder with debugmodel shapes, random weights, and
    the embedded corpus' tokenizer."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("hf") / "llama"
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=8, rms_norm_eps=1e-5,
        max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (folder / f).write_bytes((REPO_ROOT / "data/boost_corpus/tokenizer" / f).read_bytes())
    return folder


@pytest.fixture(scope="module")
def cola_from_hf(hf_llama, corpus_dir, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("cola") / "step-0"
    proc = _from_dense("--from", str(hf_llama), "--to", str(out), "--tp", "2",
                       "--calib-sequences", "8", "--calib-seq-len", "128",
                       config="debug_cola.toml")  # fmt: skip
    assert "relative activation error" in proc.stdout and f"wrote {out}" in proc.stdout
    # the last line: how to train on from it, at the recommended learning rate and warm-up
    lr, warmup = f"{continue_lr(3e-3):.3g}", CONTINUE_WARMUP  # the debug configs' lr 3e-3
    assert proc.stdout.rstrip().splitlines()[-1] == (
        f"  CONFIG_FILE={CONFIGS / 'debug_cola.toml'} NGPU=1 ./run_train.sh --model.flavor "
        f"{out} --checkpoint.enable --checkpoint.initial_load_path {out} --job.dump_folder "
        f"{out}-train --training.steps {CONTINUE_STEPS} --optimizer.lr {lr} "
        f"--lr_scheduler.warmup_steps {warmup}"
    )  # from a Hugging Face folder: no dataset_seed (its data is new to the model)
    assert "the data starts from its first sample" in proc.stdout
    report = json.loads((out.parent / "step-0.from_dense.json").read_text())
    return out, report


def test_cola_fit_beats_plain_svd(cola_from_hf):
    _, report = cola_from_hf
    assert report["fit"] and report["fit_tokens"] == 7 * 128 and report["heldout_tokens"] == 128
    rows = [p for layer in report["layers"] for p in layer["projections"].values()]
    assert len(rows) == 28
    for p in rows:
        assert p["act_fitted"] < p["act_refit"] <= p["act_plain"]
    mean = {k: sum(p[k] for p in rows) / len(rows) for k in rows[0] if k != "rank"}
    print(f"\nCoLA from random HF weights, mean activation error: {mean}")
    assert mean["act_fitted"] < 0.8 * mean["act_plain"]
    assert mean["heldout_fitted"] < mean["heldout_plain"]


def test_converted_cola_trains_under_tp2_with_the_first_loss_of_one_process(cola_from_hf, tmp_path):
    out, _ = cola_from_hf
    from boost_titan.checkpoint import integrity

    assert integrity.verify(out) == []  # `checkpoint verify`: every checksum
    assert_safe_metadata(out)  # .metadata reads through the allowlisted unpickler
    # the step records its model (the dense eps 1e-5, not cola_llama2's 1e-6): named
    load = ("--checkpoint.initial_load_path", str(out), "--model.flavor", str(out),
            "--debug.seed", "7")  # fmt: skip
    one = run_training("debug_cola.toml", 1, tmp_path / "one", *COMMON, *load, *TWO_STEPS)
    tp2 = run_training("debug_cola_btp_tp2.toml", 2, tmp_path / "tp2", *COMMON, *load, *TWO_STEPS)
    for run in (one, tp2):
        assert f"Loaded checkpoint {out} ([checkpoint] initial_load_path)" in run.output
    a, b = one.losses(), tp2.losses()
    print(f"\nconverted CoLA: one process {a}, BTP TP2 {b}")
    assert len(a) == len(b) == 2 and all(0 < x < 20 for x in a + b)
    assert abs(a[0] - b[0]) <= 1e-4 * a[0]


def test_llama2_dcp_converts_to_svd_and_trains_with_loro(corpus_dir, tmp_path):
    from boost_titan.checkpoint.export import write_dcp_model

    dense = dense_model("debugmodel", seed=2)
    src = write_dcp_model(dense.state_dict(), tmp_path / "dense" / "step-5")
    out = tmp_path / "svd" / "step-0"
    proc = _from_dense("--from", str(src), "--to", str(out), "--rank", "32",
                       config="debug_svd_loro.toml")  # fmt: skip
    assert "plain SVD" in proc.stdout and "activation error" not in proc.stdout
    # a model-only step records no data position: the config's seed 0 + 1
    assert "the step records no data position (model-only): the config's seed 0 + 1" in proc.stdout
    assert proc.stdout.rstrip().endswith("--training.dataset_seed 1")
    report = json.loads((out.parent / "step-0.from_dense.json").read_text())
    assert report["rank"] == 32 and not report["fit"] and report["calibration_tokens"] == 0
    run = run_training(
        "debug_svd_loro.toml", 1, tmp_path / "loro", *COMMON, *TWO_STEPS,
        "--checkpoint.initial_load_path", str(out), "--model.flavor", str(out),  # rank 32
        "--optimizer.loro_freq", "2",  # step 2 is an exact (manifold) step
    )  # fmt: skip
    losses = run.losses()
    assert len(losses) == 2 and all(math.isfinite(x) and 0 < x < 20 for x in losses)
    # the converted factors went through LORO's exact (manifold) step, every pair of them
    assert "LORO exact step at step 2" in run.output and "(28 factor pairs)" in run.output


# ----------------------------------------------------------------------------- refusals
def _refused(
    argv: list[str], capsys, tmp_path: Path, *needles: str, rc: int = 1, main=cli.main
) -> None:
    before = sorted(p.name for p in tmp_path.iterdir())
    try:
        got = main(argv)
    except SystemExit as e:  # argparse's usage errors
        got = e.code
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.strip() and not l.startswith("note:")]
    assert got == rc, err
    assert "Traceback" not in err and len(lines) == 1, err  # no usage dump before it
    assert all(n in lines[0] for n in needles), err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


def test_bad_inputs_fail_in_one_line_and_write_nothing(hf_llama, tmp_path, capsys):
    cfg = ["--job.config_file", str(CONFIGS / "debug_svd.toml"), "--no-progress"]
    out = str(tmp_path / "step-0")

    def refused(extra, *needles, rc=1):
        _refused([*cfg, "--to", out, *extra], capsys, tmp_path, *needles, rc=rc)

    gpt = tmp_path / "gpt2"
    gpt.mkdir()
    (gpt / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 256}))
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_bytes((hf_llama / "config.json").read_bytes())
    existing = tmp_path / "existing"
    existing.mkdir()
    refused(["--from", str(gpt)], "is not a Hugging Face LLaMA folder", "model_type 'gpt2'")
    refused(["--from", str(no_weights)], "has no weights")
    nowhere = str(tmp_path / "nowhere")
    refused(["--from", nowhere], f"--from {nowhere!r} does not exist")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    refused(["--from", str(fifo)], f"{str(fifo)!r} is not a folder (a FIFO, socket or device)")
    refused(["--from", str(hf_llama), "--rank", "300"], "rank", "300")
    refused(["--from", str(hf_llama), "--rank", "0"], "--rank 0: a rank is a positive integer",
            "leave --rank out for the flavor's", rc=2)  # fmt: skip
    refused(["--from", str(hf_llama), "--kv-rank", "-3"], "--kv-rank -3: a rank is a positive",
            rc=2)  # fmt: skip
    refused([], "the following arguments are required: --from", rc=2)
    refused(["--from", str(hf_llama), "--tp", "3"], "tensor_parallel_degree 3 does not divide")
    refused(["--from", str(hf_llama), "--tp", "2", "--rank", "63", "--boost.tp_plan", "vanilla"],
            "tensor_parallel_degree 2 does not divide rank of wq=63")  # fmt: skip
    refused(["--from", str(hf_llama), "--model.flavor", "60m"], "flavor '60m'",
            "dim 256 (flavor: 512)", "give --rank R")  # fmt: skip
    refused(["--from", str(hf_llama), "--model.name", "llama2"], "writes a low-rank model")
    if not torch.cuda.is_available():
        refused(["--from", str(hf_llama), "--device", "cuda"], "CUDA is not available")
    refused(["--from", str(hf_llama), "--fit", "activations", "--calib-sequences", "0"],
            "needs calibration", rc=2)  # fmt: skip
    _refused([*cfg, "--from", str(hf_llama), "--to", str(existing)], capsys, tmp_path, "exists")


_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 8192,
    "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 512, "rope_theta": 10000.0, "hidden_act": "silu",
    "tie_word_embeddings": False,
}  # fmt: skip
_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip


def _with(**changes) -> str:
    return json.dumps({**_LLAMA_CONFIG, **changes})


_INT = "is not a JSON integer in"
_POS = "is not a finite number > 0"
# case -> (config.json's text, the refusal after "config.json": the layout's, or (after
# "|") the file's as it is read, naming its path)
_BAD_CONFIGS = {
    "hidden_size-float": (_with(hidden_size=64.0), f": hidden_size = 64.0 {_INT} [1, 131,072]"),
    "hidden_size-string": (_with(hidden_size="64"), f': hidden_size = "64" {_INT} [1, 131,072]'),
    "layers-bool": (_with(num_hidden_layers=True), f": num_hidden_layers = true {_INT} [1, 1,024]"),
    "layers-10^12": (_with(num_hidden_layers=10**12),
                     f": num_hidden_layers = 1000000000000 {_INT} [1, 1,024]"),
    "vocab-2^40": (_with(vocab_size=2**40), f": vocab_size = 1099511627776 {_INT} [1, 16,777,216]"),
    "positions--1": (_with(max_position_embeddings=-1),
                     f": max_position_embeddings = -1 {_INT} [0, 16,777,216]"),
    "eps-string": (_with(rms_norm_eps="1e-6"), f': rms_norm_eps = "1e-6" {_POS}'),
    "eps--1": (_with(rms_norm_eps=-1), f": rms_norm_eps = -1 {_POS}"),
    "theta--5": (_with(rope_theta=-5), f": rope_theta = -5 {_POS}"),
    "theta-abc": (_with(rope_theta="abc"), f': rope_theta = "abc" {_POS}'),
    "theta-in-parameters": (_with(rope_parameters={"rope_type": "default", "rope_theta": 0}),
                            f": rope_parameters.rope_theta = 0 {_POS}"),
    "rope_parameters-list": (_with(rope_parameters=[1]),
                             ": rope_parameters = [1] is not a JSON object"),
    "llama3-low-is-high": (
        _with(rope_scaling={**_LLAMA3, "low_freq_factor": 4.0}),
        ": rope_scaling.low_freq_factor = 4.0 is not below rope_scaling.high_freq_factor = 4.0 "
        "(llama3 RoPE scaling blends the frequencies between them, dividing by their difference)",
    ),
    "llama3-factor-0": (_with(rope_scaling={**_LLAMA3, "factor": 0}),
                        f": rope_scaling.factor = 0 {_POS}"),
    # Python's json reads these; they are not JSON
    "llama3-factor-NaN": (_with(rope_scaling={**_LLAMA3, "factor": 8.5}).replace("8.5", "NaN"),
                          "|: factor = NaN is not JSON (JSON numbers are finite)"),
    "theta-Infinity": (_with(rope_theta=1.5).replace("1.5", "Infinity"),
                       "|: rope_theta = Infinity is not JSON (JSON numbers are finite)"),
    "top-level-array": ("[1, 2]", "| holds an array, not a JSON object"),
    "nested-100000": ("[" * 100_000 + "]" * 100_000,
                      "| is not JSON we read: its arrays or objects nest deeper than Python's "
                      "JSON reader goes"),
    "not-json": ("{", "| is not JSON: Expecting property name enclosed in double quotes "
                 "(line 1, column 2)"),
}  # fmt: skip


def test_a_config_json_no_model_runs_with_is_refused_when_read(tmp_path, capsys):
    """Issue 56, items 8a and 10: from-dense's config.json was read unchecked: a float
    or string hidden_size, a top-level array, a rope_parameters list, 100,000 nested
    brackets were tracebacks, 10^12 layers was killed for memory, and an eps of "1e-6"
    or -1, a theta of -5, a llama3 factor NaN or equal frequency factors were written
    into the step and refused at launch or never. Each is now one line naming the file,
    the key, the value and what is valid, before anything is written (the shared
    check of boost_titan.models.fields, which a step's model_args.json gets too)."""
    from boost_titan.checkpoint.from_dense.source import HFSource

    cfg = ["--job.config_file", str(CONFIGS / "debug_svd.toml"), "--no-progress"]
    out = tmp_path / "out" / "step-0"
    for i, (case, (text, says)) in enumerate(_BAD_CONFIGS.items()):
        folder = tmp_path / case
        folder.mkdir()
        (folder / "config.json").write_text(text)
        if says.startswith("|"):  # the file refused as it is read
            line = f"{folder / 'config.json'}{says[1:]}"
        else:  # its values refused by the layout that reads them
            line = f"folder {str(folder)!r} is not a Hugging Face LLaMA folder: config.json{says}"
        with pytest.raises(ValueError) as info:
            HFSource(folder)  # what from-dense reads --from with
        assert str(info.value) == line, case
        if i % 6 == 0:  # and as the command prints it (0.2 s of CPU each: a few)
            assert cli.main([*cfg, "--from", str(folder), "--to", str(out)]) == 1, case
            err = capsys.readouterr().err
            assert err == f"boost-titan checkpoint from-dense: error: {line}\n", case
    assert not (tmp_path / "out").exists()


def _record(**changes) -> str:
    from boost_titan.models.args import LlamaArgs
    from boost_titan.models.recorded import args_record

    args = LlamaArgs(dim=64, n_layers=2, n_heads=4, vocab_size=256, ffn_dim=128, arch="svd",
                     rank=16)  # fmt: skip
    record = args_record(args)
    record["model_args"].update(changes)
    return json.dumps(record)


# case -> (model_args.json's text, the refusal after its name)
_BAD_RECORDS = {
    "nested": ('{"format_version": 1, "model_args": ' + "[" * 100_000 + "]" * 100_000 + "}",
               " is not JSON we read: its arrays or objects nest deeper than Python's JSON "
               "reader goes"),
    "eps--1": (_record(norm_eps=-1), f": norm_eps = -1 {_POS}"),
    "theta-Infinity": (_record(rope_theta=1.5).replace("1.5", "Infinity"),
                       ": rope_theta = Infinity is not JSON (JSON numbers are finite)"),
    "vocab-2^40": (_record(vocab_size=2**40),
                   f": vocab_size = 1099511627776 {_INT} [1, 16,777,216]"),
    "layers-10^9": (_record(n_layers=10**9), f": n_layers = 1000000000 {_INT} [1, 1,024]"),
    "dim-float": (_record(dim=64.0), f": dim = 64.0 {_INT} [1, 131,072]"),
    "rank-string": (_record(rank="16"), f': rank = "16" {_INT} [0, 131,072]'),
    "swiglu-string": (_record(swiglu="yes"), ': swiglu = "yes" is not true or false'),
    "llama3-low-is-high": (
        _record(rope_scaling_factor=8.0, rope_low_freq_factor=2, rope_high_freq_factor=1),
        ": rope_low_freq_factor = 2 is not below rope_high_freq_factor = 1 (llama3 RoPE "
        "scaling blends the frequencies between them, dividing by their difference)",
    ),
    "array": ("[]", " holds an array, not a JSON object"),
}  # fmt: skip


def test_a_recorded_model_no_model_runs_with_is_refused_when_read(tmp_path):
    """Issue 56, item 8b: a step's model_args.json was type-checked but not bounded:
    nested JSON was a 44-line RecursionError, and eps -1, theta Infinity, a 2^40
    vocabulary and 10^9 layers passed the config check (``[model] flavor = <step>``,
    which reads it through ``flavor_at``). The same rule as a config.json's now."""
    from boost_titan.checkpoint.model_args import flavor_at

    for case, (text, says) in _BAD_RECORDS.items():
        step = tmp_path / case
        step.mkdir()
        (step / "model_args.json").write_text(text)
        with pytest.raises(ValueError) as info:
            flavor_at(str(step), "svd", "svd_llama2")
        assert str(info.value) == f"model arguments {str(step / 'model_args.json')!r}{says}", case
    assert sorted(p.name for p in (tmp_path / "eps--1").iterdir()) == ["model_args.json"]
    (tmp_path / "eps--1" / "model_args.json").write_text(_record())
    assert flavor_at(str(tmp_path / "eps--1"), "svd", "svd_llama2").rank == 16


def _damaged_safetensors(folder: Path) -> dict[str, Path]:
    """Small safetensors files cut short, with a header length of 2^60, with a tensor's
    offsets past the end of the file, an unknown dtype, a 2^80-element shape and a
    200,000-deep header (issue #48, finding 6: each was a traceback)."""
    import struct

    from safetensors.torch import save_file

    good = folder / "good.safetensors"
    save_file({"a": torch.ones(4, 4), "b": torch.zeros(8)}, str(good), metadata={"format": "pt"})
    data = good.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    header["b"]["data_offsets"] = [64, 64 + 10**6]
    moved = json.dumps(header).encode()

    def with_header(edit) -> bytes:
        h = json.loads(data[8 : 8 + n])
        edit(h)
        text = json.dumps(h).encode()
        return struct.pack("<Q", len(text)) + text + data[8 + n :]

    deep = b'{"a": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    files = {
        "cut short": data[: len(data) - 10],
        "header length 2^60": struct.pack("<Q", 2**60) + data[8:],
        "offsets past the end": struct.pack("<Q", len(moved)) + moved + data[8 + n :],
        "unknown dtype": with_header(lambda h: h["a"].update(dtype="Q99")),
        "huge shape": with_header(lambda h: h["a"].update(shape=[2**40, 2**40])),
        "deep header": struct.pack("<Q", len(deep)) + deep + data[8 + n :],
    }
    out = {}
    for i, (what, content) in enumerate(files.items()):
        out[what] = folder / f"damaged{i}.safetensors"
        out[what].write_bytes(content)
    return out


def test_a_damaged_safetensors_file_is_one_line(hf_llama, tmp_path, capsys):
    """from-dense (a Hugging Face folder's model.safetensors) and ``checkpoint import``
    (the file itself) name the file, its size and what is wrong: no traceback."""
    from boost_titan.cli import checkpoint

    files = tmp_path / "files"
    files.mkdir()
    cfg = ["--job.config_file", str(CONFIGS / "debug_svd.toml")]
    for damaged in _damaged_safetensors(files).values():
        folder = tmp_path / f"hf_{damaged.stem}"
        folder.mkdir()
        (folder / "config.json").write_bytes((hf_llama / "config.json").read_bytes())
        (folder / "model.safetensors").write_bytes(damaged.read_bytes())
        size = f"({damaged.stat().st_size:,} bytes) is not a readable safetensors file"
        _refused([*cfg, "--no-progress", "--from", str(folder), "--to", str(tmp_path / "out")],
                 capsys, tmp_path, f"{str(folder / 'model.safetensors')!r} {size}")  # fmt: skip
        _refused(["import", *cfg, "--from", str(damaged), "--to", str(tmp_path / "out")],
                 capsys, tmp_path, f"boost-titan checkpoint import: error: {str(damaged)!r} {size}",
                 main=checkpoint.main)  # fmt: skip


def test_refusal_through_the_module_entry_point(hf_llama, tmp_path):
    out = tmp_path / "step-0"
    proc = _from_dense("--from", str(hf_llama), "--to", str(out), "--rank", "257",
                       config="debug_cola.toml", expect_rc=1)  # fmt: skip
    assert proc.stderr.strip().splitlines()[-1].startswith(f"{cli.PROG}: error: ")
    assert "Traceback" not in proc.stderr and not list(tmp_path.iterdir())
