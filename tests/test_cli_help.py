"""``boost-titan``'s command line reads well: every command of the table
(``boost_titan.cli.main.COMMANDS``) and every ``checkpoint`` command answers ``--help``
with exit 0 and its own usage, naming the command, its required options and valid
values; a command line it cannot run is one line naming what is wrong and what is valid.

In this process: ``main(argv)`` as the console script calls it (``--help`` exits through
SystemExit, as argparse does), so the walk costs the commands' imports once."""

from __future__ import annotations

import pytest
from helpers import REPO_ROOT

from boost_titan.cli import checkpoint
from boost_titan.cli.main import COMMANDS, main

# what a usage must show besides the command's name: required options, valid values
SHOWS = {
    "check-config": ["WORLD_SIZE", "--job.config_file CONFIG", "required"],
    "checkpoint": ["{export,import,verify,from-dense}", "--job.config_file"],
    "checkpoint export": [
        "--job.config_file CONFIG --from STEP --to FILE",
        "{safetensors,hf}",
        "{bfloat16,float16,float32}",
        "{boost,llama,cola}",
    ],  # fmt: skip
    "checkpoint import": ["--job.config_file CONFIG --from FILE --to STEP", "{safetensors,hf}"],
    "checkpoint verify": ["PATH [PATH ...]"],
    "checkpoint from-dense": [
        "--job.config_file CONFIG --from DENSE --to STEP",
        "{auto,none,activations}",
        "1 to min(in, out)",
    ],  # fmt: skip
    "search": ["--gpus", "--write"],
    "plan": ["--search", "{cola_llama2,lax_llama2,llama2,svd_llama2}"],
    "dryrun": ["--config CONFIG", "--ngpu NGPU"],
    "screenshot": ["--logdir LOGDIR"],
    "peak-flops": ["{float32,bfloat16}"],
    "data": ["{build,info,tokenizer,tokenize,seal}"],
}


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code or 0, out.out, out.err


def test_every_command_answers_help_with_its_own_usage(capsys):
    names = [*COMMANDS, *(f"checkpoint {c}" for c in checkpoint.COMMANDS)]
    assert len(names) >= 18 and set(SHOWS) <= set(names)
    for name in names:
        code, out, err = _run([*name.split(), "--help"], capsys)
        assert code == 0, f"{name} --help: exit {code}\n{err[-2000:]}"
        usage = out.split("\n\n")[0]
        assert usage.startswith(f"usage: boost-titan {name} "), f"{name} --help:\n{out[:400]}"
        for text in SHOWS.get(name, ()):
            assert text in out, f"{name} --help does not show {text!r}:\n{out}"
    # the checkpoint commands' texts are their own, not one shared text
    texts = {c: _run(["checkpoint", c, "--help"], capsys)[1] for c in checkpoint.COMMANDS}
    assert len(set(texts.values())) == len(texts)
    assert "--dtype" not in texts["import"] and "--rank" not in texts["export"]


@pytest.mark.parametrize(
    "argv, line",
    [
        (["checkpoint"], "boost-titan checkpoint: error: no command; valid: export, import, "
         "verify, from-dense (boost-titan checkpoint --help)"),
        (["chekpoint"], "boost-titan: error: unknown command 'chekpoint'; valid: "
         f"{', '.join(COMMANDS)}"),
        (["checkpoint", "exprot"], "boost-titan checkpoint: error: unknown command 'exprot'; "
         "valid: export, import, verify, from-dense (boost-titan checkpoint --help)"),
        (["checkpoint", "export", "--from", "x"], "boost-titan checkpoint export: error: the "
         "following arguments are required: --job.config_file, --to "
         "(boost-titan checkpoint export --help)"),
        (["checkpoint", "import", "--format", "gguf"], "boost-titan checkpoint import: error: "
         "argument --format: invalid choice: 'gguf' (choose from {safetensors}, {hf}) "
         "(boost-titan checkpoint import --help)"),
        (["check-config", "two"], "boost-titan check-config: error: WORLD_SIZE must come "
         "first, a positive process count (got 'two'); usage: boost-titan check-config "
         "WORLD_SIZE --job.config_file CONFIG [--section.key VALUE ...]"),
    ],
)  # fmt: skip
def test_a_bad_command_line_is_one_line(argv, line, capsys):
    code, out, err = _run(argv, capsys)
    # argparse quotes the choices before Python 3.12.8 / 3.13.1: either
    lines = [[line.replace("{safetensors}", f"{q}safetensors{q}").replace("{hf}", f"{q}hf{q}")]
             for q in ("'", "")]  # fmt: skip
    assert code == 2 and out == "" and err.splitlines() in lines, err


_TP2 = "train_configs/debug_cola_btp_tp2.toml"


@pytest.mark.parametrize(
    "argv, code",
    [
        (["check-config", "2", "--job.config_file", _TP2, "--parallelism.tensor_parallel_degree",
          "3"], 2),
        (["check-config", "2", "--job.config_file", "nope.toml"], 2),  # (a FileNotFoundError)
        (["check-config", "2", "--job.config_file", _TP2, "--model.converters", "float8"], 2),
        (["data", "tokenize", "--from", "/nonexistent", "--tokenizer", "x", "--out", "{tmp}"], 1),
        (["data", "info", "--out", "{tmp}/none"], 1),
        (["step-time", "--model", "bogus"], 2),
        (["plan", "--model", "bogus"], 2),
        (["search", "--gpu", "v100"], 2),
        (["dryrun", "--config", "/nonexistent.toml", "--ngpu", "2"], 2),
        (["eval", "--model", "{tmp}"], 2),
        (["bench", "--tp", "0"], 2),
        (["bench-loro", "--tp", "0"], 2),
        (["peak-flops", "--n", "0"], 2),
        (["recipes"], 2),
    ],
    ids=lambda v: " ".join(v[:3]) if isinstance(v, list) else None,
)  # fmt: skip
def test_refusals_are_one_line_without_a_class_name(argv, code, capsys, monkeypatch, tmp_path):
    """Every command refuses in one line, ``boost-titan <command>: error: <message>``:
    the message alone, never Python's class name (``ValueError: [parallelism] ...``
    before), one mechanism for all (``boost_titan.config.refuse``)."""
    import re

    monkeypatch.setenv("WORLD_SIZE", "2")  # (check-config sets it for its checks)
    monkeypatch.chdir(REPO_ROOT)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    got, out, err = _run(argv, capsys)
    command = " ".join(argv[:2]) if argv[0] == "data" else argv[0]
    assert (got, out) == (code, ""), err
    assert len(err.splitlines()) == 1 and err.startswith(f"boost-titan {command}: error: "), err
    assert not re.search(r"\b[A-Z]\w*(Error|Exception|Exit): ", err), err


_MARKUP = ("``", ":mod:", ":class:", ":func:", ":meth:", ":data:", ":attr:")


def test_every_help_is_plain_and_complete(capsys, monkeypatch):
    """Every command and subcommand, walked from the parsers themselves: its help shows
    no reST markup (the docstrings it is built from are reST), every option and
    subcommand has a help text, and the top-level listing names every subcommand of a
    command group (``data``'s tokenize and seal were missing)."""
    import argparse

    from boost_titan.config import Parser

    shown: list[Parser] = []  # every parser whose help was printed, in order
    format_help = Parser.format_help
    monkeypatch.setattr(Parser, "format_help", lambda p: shown.append(p) or format_help(p))
    top = _run(["--help"], capsys)[1]
    texts, missing, groups = {"boost-titan": top}, [], {"checkpoint": list(checkpoint.COMMANDS)}
    todo = [[name] for name in COMMANDS] + [["checkpoint", c] for c in checkpoint.COMMANDS]
    while todo:
        argv = todo.pop(0)
        del shown[:]
        code, out, err = _run([*argv, "--help"], capsys)
        assert code == 0, f"{argv} --help: exit {code}\n{err[-2000:]}"
        texts[" ".join(argv)] = out
        for parser in shown[:1]:  # (none: a usage of its own, checkpoint and check-config)
            for action in parser._actions:
                if isinstance(action, argparse._SubParsersAction):
                    groups[" ".join(argv)] = list(action.choices)
                    todo += [[*argv, sub] for sub in action.choices]
                    missing += [f"{argv} {a.dest}" for a in action._choices_actions if not a.help]
                elif not action.help:  # (argparse.SUPPRESS: hidden on purpose)
                    missing.append(
                        f"{' '.join(argv)} {'/'.join(action.option_strings) or action.dest}"
                    )
    assert len(texts) == 1 + len(COMMANDS) + sum(map(len, groups.values())), sorted(texts)
    marked = {name: [m for m in _MARKUP if m in text] for name, text in texts.items()}
    assert not {k: v for k, v in marked.items() if v}, "reST markup in --help"
    assert not missing, f"options without help: {missing}"
    assert groups.keys() >= {"checkpoint", "data"}
    import re

    for group, subs in groups.items():
        summary = COMMANDS[group].summary
        absent = [s for s in subs if not re.search(rf"(?<![\w-]){re.escape(s)}(?![\w-])", summary)]
        assert not absent, f"boost-titan --help lists {group} without {absent}: {summary!r}"
        assert all(s in texts[f"{group} {s}"].split("\n")[0] for s in subs)
