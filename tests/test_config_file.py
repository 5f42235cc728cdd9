"""`extends` in training TOMLs (boost_titan.train.config_file): merge order, chains,
relative paths and the errors for loops and missing bases."""

from __future__ import annotations

import pytest

from boost_titan.train.config_file import ConfigFileError, load_config_toml


def _write(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_config_overrides_base_key_by_key_through_a_chain(tmp_path):
    root = "[training]\nsteps = 20\nseq_len = 256\n[debug]\nseed = 42\n"
    _write(tmp_path / "base/root.toml", root)
    _write(
        tmp_path / "base/debug.toml",
        'extends = "root.toml"\n[training]\nseq_len = 128\n[model]\nname = "x"\n',
    )
    cfg = _write(
        tmp_path / "run.toml",
        'extends = "base/debug.toml"\n[training]\nsteps = 5\n[model]\nflavor = "f"\n',
    )
    assert load_config_toml(str(cfg)) == {
        "training": {"steps": 5, "seq_len": 128},
        "debug": {"seed": 42},
        "model": {"name": "x", "flavor": "f"},
    }


def test_missing_base_and_loops_are_named(tmp_path):
    cfg = _write(tmp_path / "run.toml", 'extends = "nope.toml"\n')
    with pytest.raises(ConfigFileError, match=r"extends = 'nope.toml' does not exist \(looked for"):
        load_config_toml(str(cfg))
    _write(tmp_path / "a.toml", 'extends = "b.toml"\n')
    _write(tmp_path / "b.toml", 'extends = "a.toml"\n')
    with pytest.raises(ConfigFileError, match=r"`extends` loops: .*a.toml -> .*b.toml -> .*a.toml"):
        load_config_toml(str(tmp_path / "a.toml"))
    _write(tmp_path / "c.toml", "extends = 3\n")
    with pytest.raises(ConfigFileError, match="extends = 3 must be a path"):
        load_config_toml(str(tmp_path / "c.toml"))


def test_shipped_debug_configs_are_thin():
    """Each debug config holds only what differs from base/debug.toml."""
    import tomllib
    from pathlib import Path

    configs = sorted(Path(__file__).resolve().parents[1].glob("train_configs/*.toml"))
    assert len(configs) >= 20
    for path in configs:
        own = tomllib.loads(path.read_text())
        assert own.pop("extends") == "base/debug.toml", path
        base = load_config_toml(str(path.parent / "base/debug.toml"))
        for section, values in own.items():
            for key, value in values.items():
                assert base.get(section, {}).get(key, object()) != value, (path, section, key)
        assert sum(len(v) for v in own.values()) <= 12, path
