"""Bad input through the real CLI (in-process), issue 26 point 8: a bool for a number, a
vocabulary smaller than the data's ids, an unreadable or misplaced config file, data file or
run folder. Each is refused with exit 2 and one paragraph naming it, before any process starts
or anything is written. Nothing here trains."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import tomli_w

from conftest import refused, tiny_tree
from loomtrain.cli import _make_run_dir
from loomtrain.component import _leaf_types
from loomtrain.errors import ConfigError
from loomtrain.train.config import Config, config_from_dict

ROOT = os.geteuid() == 0  # root reads a chmod 000 file and writes a chmod 555 folder
UNREADABLE = "/proc/self/mem"  # a regular file whose read fails for every user (EIO at offset 0)


def _tiny(tmp_path: Path, corpus: Path, **sections) -> str:
    path = tmp_path / "tiny.toml"
    path.write_text(tomli_w.dumps(tiny_tree(tmp_path, corpus, **sections)))
    return str(path)


# --- a bool is not a number ---------------------------------------------------------------

def _number_keys() -> list[str]:
    keys = []
    for section, field in Config.model_fields.items():
        for key, f in field.annotation.model_fields.items():
            leaves = _leaf_types(f.annotation)
            if leaves & {int, float} and bool not in leaves:
                keys.append(f"{section}.{key}")
    return keys


def test_every_number_key_refuses_a_bool():
    keys = _number_keys()
    assert len(keys) > 60  # every int and float key of every section, the components' too
    for key in keys:
        section, name = key.split(".")
        with pytest.raises(ConfigError, match=f"{key}: .* is expected, not a boolean"):
            config_from_dict({section: {name: True}})


@pytest.mark.parametrize("override,expected", [
    ("train.steps=true", "train.steps: an integer is expected, not a boolean (got True)"),
    ("train.lr=false", "train.lr: a number is expected, not a boolean (got False)"),
    ("parallel.nproc=true", "parallel.nproc: an integer is expected, not a boolean"),
    ("comm.link_changes=[[true, 0.5]]", "comm.link_changes: a number is expected, not a boolean"),
])
def test_a_bool_for_a_number_is_refused(capsys, override, expected):
    assert expected in refused(capsys, ["train", "--dry-run", "--set", override])


def test_bool_keys_still_take_bools():
    cfg = config_from_dict({"run": {"progress": False}, "model": {"linear_decay": False}})
    assert cfg.run.progress is False


# --- the vocabulary against the data -------------------------------------------------------

def test_dry_run_checks_the_stdlib_against_the_vocabulary(capsys):
    err = refused(capsys, ["train", "--dry-run", "--set", "model.vocab_size=100"])
    assert "data.source='stdlib' is read as bytes" in err
    assert "its largest is" in err and "model.vocab_size=100" in err


@pytest.mark.parametrize("dry", [["--dry-run"], []])
def test_token_ids_beyond_the_vocabulary(tmp_path, corpus, capsys, dry):
    tokens = tmp_path / "tokens.bin"
    (np.arange(4000, dtype=np.uint16) % 301).tofile(tokens)
    cfg = _tiny(tmp_path, corpus, data={"source": str(tokens)}, model={"vocab_size": 256})
    err = refused(capsys, ["train", *dry, cfg])
    assert "holds token id 300, but model.vocab_size=256" in err
    assert not (tmp_path / "runs").exists()  # refused before the run folder is made


# --- files that cannot be read --------------------------------------------------------------

def test_config_path_that_is_a_directory(tmp_path, capsys):
    err = refused(capsys, ["train", "--dry-run", str(tmp_path)])
    assert f"config file {str(tmp_path)!r} is a directory" in err


def test_config_file_that_cannot_be_read(capsys):
    err = refused(capsys, ["train", "--dry-run", UNREADABLE])
    assert f"config file {UNREADABLE!r} cannot be read (Input/output error)" in err


@pytest.mark.skipif(ROOT, reason="root reads a file without read permission")
def test_config_file_without_read_permission(tmp_path, corpus, capsys):
    path = Path(_tiny(tmp_path, corpus))
    path.chmod(0)
    err = refused(capsys, ["train", "--dry-run", str(path)])
    assert f"config file {str(path)!r} cannot be read (Permission denied)" in err


def test_data_file_that_cannot_be_read(tmp_path, corpus, capsys):
    cfg = _tiny(tmp_path, corpus, data={"source": UNREADABLE})
    err = refused(capsys, ["train", cfg])
    assert f"data.source={UNREADABLE!r}: cannot read {UNREADABLE!r}" in err
    assert not (tmp_path / "runs").exists()


# --- run folders that cannot be used --------------------------------------------------------

@pytest.mark.parametrize("under", ["", "sub"])
def test_run_dir_that_is_or_is_under_a_file(tmp_path, corpus, capsys, under):
    blocker = tmp_path / "afile"
    blocker.write_text("kept")
    run_dir = blocker / under if under else blocker
    err = refused(capsys, ["train", _tiny(tmp_path, corpus, run={"dir": str(run_dir)})])
    assert f"run folder {str(run_dir / 't')!r} cannot be used: {str(blocker)!r} is a file" in err
    assert blocker.read_text() == "kept"


def test_run_dir_under_proc(tmp_path, corpus, capsys):
    err = refused(capsys, ["train", _tiny(tmp_path, corpus, run={"dir": "/proc/loom-runs"})])
    assert "run folder '/proc/loom-runs/t' cannot be used: it cannot be created" in err


def _read_only(folder: Path):
    """Make `folder` unwritable for this user: chmod 555, or as root (who writes there anyway)
    the immutable attribute; returns the undo, or None where neither is possible here."""
    if not ROOT:
        folder.chmod(0o555)
        return lambda: folder.chmod(0o755)
    chattr = shutil.which("chattr")
    if chattr is None or subprocess.run([chattr, "+i", str(folder)], capture_output=True).returncode:
        return None  # no CAP_LINUX_IMMUTABLE, or a filesystem without the attribute
    return lambda: subprocess.run([chattr, "-i", str(folder)], check=True)


@pytest.fixture
def locked(tmp_path):
    """A folder this user cannot write, unlocked after the test."""
    folder = tmp_path / "locked"
    folder.mkdir()
    undo = _read_only(folder)
    if undo is None:
        pytest.skip("running as root without chattr +i here: no folder is read-only to root")
    yield folder
    undo()


def test_run_dir_that_cannot_be_written(tmp_path, corpus, capsys, locked):
    err = refused(capsys, ["train", _tiny(tmp_path, corpus, run={"dir": str(locked)})])
    why = "Operation not permitted" if ROOT else "Permission denied"
    assert f"run folder {str(locked / 't')!r} cannot be used: it cannot be created ({why})" in err


def test_existing_run_folder_that_cannot_be_written(locked):
    # the folder of --resume, or under torchrun run.dir/run.name exactly: it exists already,
    # so a file is written there to find out
    with pytest.raises(ConfigError, match=f"run folder {str(locked)!r} cannot be used: no file "
                                          "can be written in it"):
        _make_run_dir(locked)
