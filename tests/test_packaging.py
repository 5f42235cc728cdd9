"""A non-editable install must ship every subpackage: build the wheel and look inside.

The build runs on a copy of the project (top-level files + the boost_titan package),
so setuptools' build/ and *.egg-info never land in the working tree.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

REQUIRED = (
    "boost_titan/__init__.py",
    "boost_titan/train/__main__.py",
    "boost_titan/parallel/cpu_runtime.py",
    "boost_titan/train/specs.py",
    "boost_titan/models/model.py",
    "boost_titan/tp_plans/btp.py",
    "boost_titan/data/corpus/build.py",
    # package data read at run time (a non-editable install has no checkout around it)
    "boost_titan/perf/gpu_base.toml",
    "boost_titan/cli/tasks/boost_corpus_ppl.yaml",
)


def _copy_project(dst: Path) -> None:
    for f in REPO_ROOT.iterdir():
        if f.is_file():
            shutil.copy2(f, dst / f.name)
    shutil.copytree(
        REPO_ROOT / "boost_titan",
        dst / "boost_titan",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
    )


def test_wheel_contains_every_subpackage(tmp_path):
    src, out = tmp_path / "src", tmp_path / "wheels"
    src.mkdir()
    _copy_project(src)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            str(src),
            "-w",
            str(out),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    wheels = list(out.glob("boost_titan-*.whl"))
    assert len(wheels) == 1, list(out.iterdir())
    with zipfile.ZipFile(wheels[0]) as zf:
        names = set(zf.namelist())
        entry_points = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        assert len(entry_points) == 1
        scripts = zf.read(entry_points[0]).decode()
    for path in REQUIRED:
        assert path in names, f"{path} missing from {wheels[0].name}"
    # every module of the source package (independent listing of the source tree)
    sources = {
        p.relative_to(REPO_ROOT).as_posix()
        for p in (REPO_ROOT / "boost_titan").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert sources, "no sources found"
    assert sources <= names, sorted(sources - names)
    # every folder holding modules is a package (has __init__.py) in the wheel
    for path in sources:
        parent = path.rsplit("/", 1)[0]
        assert f"{parent}/__init__.py" in names, parent
    # no tests, configs or data leak into the wheel
    assert not any(n.startswith(("tests/", "train_configs/", "data/")) for n in names)
    # the one console script of pyproject.toml
    assert "boost-titan = boost_titan.cli.main:console_script" in scripts
