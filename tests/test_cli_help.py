"""``boost-titan``'s command line reads well: every command of the table
(``boost_titan.cli.main.COMMANDS``) and every ``checkpoint`` command answers ``--help``
with exit 0 and its own usage, naming the command, its required options and valid
values; a command line it cannot run is one line naming what is wrong and what is valid.

In this process: ``main(argv)`` as the console script calls it (``--help`` exits through
SystemExit, as argparse does), so the walk costs the commands' imports once."""

from __future__ import annotations

import pytest

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
