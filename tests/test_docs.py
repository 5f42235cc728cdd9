"""The README and docs/*.md name only things that exist, and run tools one way.

Checked, statically (well under a second, nothing imports torch):
- every command in a fenced or indented code block, or an inline code span, that runs a
  tool as ``.venv/bin/boost-titan X`` names a command X of ``boost-titan`` (its table,
  ``boost_titan.cli.main.COMMANDS``, whose modules resolve: ``find_spec`` is cheap, the
  package imports no torch), and one that runs Python as ``.venv/bin/python -m X``
  names a module that resolves; a bare ``boost-titan X`` or ``python -m`` is refused: the
  docs use ``.venv/bin/`` everywhere, which works in a fresh shell after ``make train``;
- every ``make T`` names a target of the Makefile;
- every relative link and image points to an existing file inside the repository, and
  a ``#anchor`` into a markdown file names one of its headings (GitHub's slugs).

Not run here: the commands themselves. Each one imports torch and torchtitan (and most
launch ranks), minutes in all. Instead every command of the README's ```bash blocks is
listed in README_COMMANDS with the test that runs it (or the same run without ``make``,
or its flags separately), or the reason none does (SLURM, a server, a second corpus
build); a README command missing there, or a test named there that does not
exist, fails.
"""

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "recipes" / "README.md"]

FENCE = re.compile(r"^```.*?$(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
PY_MODULE = re.compile(r"([^\s(`'\"]*python[\w.]*) -m ([A-Za-z_][\w.]*)")
TOOL = re.compile(r"([^\s(`'\"]*)boost-titan(?: ([a-z][\w-]*))?")
# a command's refusal shown as its output (``boost-titan check-config: error: ...``)
REFUSAL = re.compile(r"\s*boost-titan [\w -]+: error: ")
MAKE = re.compile(r"(?:^|[;&|]\s*|^\s*)make((?:\s+[A-Z_]+=\S+|\s+[a-z][\w-]*)*)")


def _code(text: str) -> list[str]:
    """Code lines: fenced blocks, indented blocks (4 spaces after a blank line), inline spans."""
    lines = [ln for block in FENCE.findall(text) for ln in block.splitlines()]
    prose = FENCE.sub("", text)
    prev_blank = True
    in_indented = False
    for ln in prose.splitlines():
        if (
            ln.startswith("    ")
            and (prev_blank or in_indented)
            and not ln.lstrip().startswith("-")
        ):
            in_indented = True
            lines.append(ln.strip())
        else:
            in_indented = False
        prev_blank = not ln.strip()
    lines += INLINE.findall(prose)
    return lines


def _slug(heading: str) -> str:
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {_slug(m) for m in re.findall(r"^#+\s+(.*)$", text, re.M)}


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {t for line in re.findall(r"^([\w .-]+):(?!=)", text, re.M) for t in line.split()}


def test_commands_name_existing_tools_one_way():
    from boost_titan.cli.main import COMMANDS

    for name, command in COMMANDS.items():
        assert importlib.util.find_spec(command.module) is not None, (name, command.module)
    tools = modules = 0
    for doc in DOCS:
        for line in _code(doc.read_text()):
            if REFUSAL.match(line):
                continue
            where = f"{doc.relative_to(ROOT)}: {line.strip()!r}"
            for interp, module in PY_MODULE.findall(line):
                assert interp == ".venv/bin/python", f"{where}: run Python as .venv/bin/python -m"
                assert importlib.util.find_spec(module) is not None, f"{where}: no module {module}"
                modules += 1
            for prefix, name in TOOL.findall(line):
                if not name:  # the command's name in prose
                    continue
                assert prefix == ".venv/bin/", f"{where}: run the tools as .venv/bin/boost-titan"
                assert name in COMMANDS, f"{where}: boost-titan has no command {name}"
                tools += 1
    assert tools >= 30, f"only {tools} boost-titan commands found: the extraction is broken"


def test_make_targets_exist():
    targets = _make_targets()
    seen = 0
    for doc in DOCS:
        for line in _code(doc.read_text()):
            for m in MAKE.finditer(line):
                words = [w for w in m.group(1).split() if "=" not in w]
                for w in words:
                    assert w in targets, (
                        f"{doc.relative_to(ROOT)}: `make {w}` is no Makefile target"
                    )
                    seen += 1
    assert seen >= 2, "no make targets found: the extraction is broken"


def test_links_point_to_files_inside_the_repository():
    seen = 0
    for doc in DOCS:
        for target in LINK.findall(FENCE.sub("", doc.read_text())):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            where = f"{doc.relative_to(ROOT)}: link {target}"
            assert dest.is_relative_to(ROOT), f"{where} points outside the repository"
            assert dest.exists(), f"{where}: no such file"
            if anchor and dest.suffix == ".md":
                assert anchor in _anchors(dest), f"{where}: no heading with that anchor"
            seen += 1
    assert seen >= 15, f"only {seen} links found: the extraction is broken"


def test_slug_matches_github():
    assert _slug("One-command GPU check (`benchmarks/gpu_check.sh`)") == (
        "one-command-gpu-check-benchmarksgpu_checksh"
    )


# Each command of the README's ```bash blocks and what runs it in the suite: a test
# (``tests/<file>.py::<function>``, which must exist) or why none does. A new README
# command fails test_every_readme_command_is_run_or_excused until it is listed here.
README_COMMANDS = {
    ".venv/bin/boost-titan search": "the same command on the debug model "
    "with a custom GPU and --write: "
    "tests/test_perf_model.py::test_search_picks_context_parallel_for_a_long_sequence_and_its_recipe_passes",
    ".venv/bin/boost-titan checkpoint export --format hf": "the same command on the "
    "debug_cola seed checkpoint (same model): tests/test_hf_export.py::"
    "test_hf_dcp_hf_round_trip_is_bitwise (its fixture exports, imports, exports again)",
    ".venv/bin/boost-titan eval": "on 3 short validation documents (--data): "
    "tests/test_hf_eval.py::test_lm_eval_perplexity_equals_the_trainers_model",
    ".venv/bin/boost-titan checkpoint import --format hf": "the same command: "
    "tests/test_hf_export.py::test_hf_dcp_hf_round_trip_is_bitwise",
    "make train NGPU=1": "the same run without make: "
    "tests/test_lowrank_train.py::test_single_process_20_steps (svd, 1 process, 20 steps)",
    "make train": "set-up: .ci/run's `make setup data`; the run (run_train.sh, 2 ranks, "
    "the default config): tests/test_train_e2e.py::test_default_run_is_reproducible",
    "make test": ".ci/run runs it for every submission",
    ".venv/bin/boost-titan data build --vocab-size": "excused: a second "
    "corpus copy and tokenizer no test needs (18 s); the 8192-token build is .ci/run's `make data` "
    "(tests/test_corpus.py::test_manifest_layout checks it)",
    ".venv/bin/boost-titan data tokenize ": "the same command in-process on a generated "
    "corpus: tests/test_tokenized_data.py::test_the_cli_tokenizes_and_refuses_in_one_line",
    ".venv/bin/boost-titan data seal": "seal() on files megatron-core wrote: "
    "tests/test_tokenized_data.py::test_megatron_reads_ours_and_we_read_megatrons",
    ".venv/bin/boost-titan data tokenizer": "the same command in-process on a "
    "generated corpus: tests/test_data_tokenizer.py::test_folder_specials_round_trip; its "
    "folder trains: tests/test_data_tokenizer.py::test_short_training_run",
    "CONFIG_FILE=train_configs/debug_lax_pp2.toml": "the config on 2 ranks: "
    "tests/test_lowrank_train.py::test_lax_pp2_matches_single_process",
    "NGPU=2 ./run_train.sh --boost.no-group-linears": "its flags, separately: --boost.log_comm "
    "in tests/test_btp_e2e.py::test_cola_btp_tp2_matches_single_process; ungrouped and "
    "sync-norm numerics in tests/test_btp.py::test_btp_matches_single_device",
    ".venv/bin/boost-titan dryrun --config recipes/": "every recipe: "
    "tests/test_dryrun.py::test_every_recipe_fits_at_its_world_size",
    "PYTHON=$PWD/.venv/bin/python sbatch": "excused: needs SLURM and GPUs",
    ".venv/bin/tensorboard": "excused: a server; the events it shows are checked by "
    "tests/test_train_e2e.py::test_tp2_tensorboard_scalars",
    "NGPU=2 ./run_train.sh --checkpoint.enable": "the fine-tuning example, all four commands: "
    "tests/test_checkpoint_options.py::test_keep_latest_k_and_the_readme_fine_tuning_example",
    ".venv/bin/boost-titan checkpoint export": "the fine-tuning example (above)",
    ".venv/bin/boost-titan checkpoint import": "the fine-tuning example (above)",
}


def _readme_commands() -> list[str]:
    """The README's ```bash commands, continuation lines joined, comments dropped."""
    out = []
    for block in re.findall(r"^```bash$(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M):
        joined = re.sub(r"\\\n\s*", " ", block)
        out += [ln.split("  #")[0].strip() for ln in joined.splitlines() if ln.strip()]
    return out


def test_every_readme_command_is_run_or_excused():
    """Each README command is listed in README_COMMANDS (its longest matching prefix),
    and each test named there exists."""
    commands = _readme_commands()
    assert len(commands) >= 10, commands
    for command in commands:
        keys = [k for k in README_COMMANDS if command.startswith(k)]
        assert keys, f"README command {command!r}: add what runs it to README_COMMANDS"
    for where in README_COMMANDS.values():
        for path, func in re.findall(r"(tests/\w+\.py)::(\w+)", where):
            source = (ROOT / path).read_text()
            assert re.search(rf"^def {func}\(", source, re.M), f"{path}::{func} does not exist"
