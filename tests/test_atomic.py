"""dorylus.atomic: a file or directory is replaced whole or not at all, with its permissions."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from dorylus import atomic


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_write_replaces_and_leaves_nothing_else(tmp_path):
    path = tmp_path / "f.json"
    path.write_text("old")
    atomic.write_json(path, {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1} and path.read_text().endswith("\n")
    atomic.write_bytes(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_a_failure_mid_write_keeps_the_old_file_and_no_temp(tmp_path):
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic.writing(path) as f:
            f.write(b"half of the new")
            f.flush()
            assert len(list(tmp_path.iterdir())) == 2  # the new bytes went to a temp file, not to path
            raise RuntimeError("disk full")
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]


def test_an_interrupt_mid_write_leaves_no_temp(tmp_path):
    path = tmp_path / "x"
    with pytest.raises(KeyboardInterrupt):
        with atomic.writing(path) as f:
            f.write(b"1")
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def test_a_missing_directory_fails_with_the_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        atomic.write_text(tmp_path / "no" / "x", "1")
    assert list(tmp_path.iterdir()) == []


def test_permissions_default_to_the_umask_and_a_mode_is_exact(tmp_path):
    old_umask = os.umask(0o027)
    try:
        atomic.write_text(tmp_path / "plain", "1")
        atomic.write_text(tmp_path / "shared", "1", mode=0o644)
        atomic.write_text(tmp_path / "secret", "1", mode=0o600)
        atomic.write_text(tmp_path / "exact", "1", mode=0o666)  # a mode is not narrowed by the umask
        with open(tmp_path / "by-open", "w"):
            pass
    finally:
        os.umask(old_umask)
    assert mode_of(tmp_path / "plain") == mode_of(tmp_path / "by-open") == 0o640
    assert (mode_of(tmp_path / "shared"), mode_of(tmp_path / "secret"), mode_of(tmp_path / "exact")) == (
        0o644, 0o600, 0o666)


def test_a_secret_is_never_readable_by_others_while_written(tmp_path):
    path = tmp_path / "k.secret"
    with atomic.writing(path, mode=0o600) as f:
        (tmp,) = tmp_path.iterdir()
        assert mode_of(tmp) == 0o600
        f.write(b"s")
    assert mode_of(path) == 0o600


def test_exclusive_refuses_an_existing_file_and_leaves_it(tmp_path):
    path = tmp_path / "k"
    atomic.write_text(path, "first", exclusive=True)
    with pytest.raises(FileExistsError):
        atomic.write_text(path, "second", exclusive=True)
    assert path.read_text() == "first"
    assert [p.name for p in tmp_path.iterdir()] == ["k"]


def test_building_dir_swaps_a_directory_in_whole(tmp_path):
    out = tmp_path / "report"
    out.mkdir()
    (out / "old.png").write_text("old")
    with atomic.building_dir(out) as tmp:
        (tmp / "new.png").write_text("new")
        assert [p.name for p in out.iterdir()] == ["old.png"]  # untouched until the block ends
    assert [p.name for p in out.iterdir()] == ["new.png"]
    assert [p.name for p in tmp_path.iterdir()] == ["report"]


def test_building_dir_failure_keeps_the_old_directory(tmp_path):
    out = tmp_path / "store"
    out.mkdir()
    (out / "meta.json").write_text("old")
    with pytest.raises(ValueError):
        with atomic.building_dir(out) as tmp:
            (tmp / "meta.json").write_text("new")
            raise ValueError
    assert (out / "meta.json").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["store"]


def test_building_dir_modes(tmp_path):
    old_umask = os.umask(0o022)
    try:
        with atomic.building_dir(tmp_path / "plain"):
            pass
        with atomic.building_dir(tmp_path / "private", mode=0o700):
            pass
    finally:
        os.umask(old_umask)
    assert (mode_of(tmp_path / "plain"), mode_of(tmp_path / "private")) == (0o755, 0o700)


def test_replace_dir_restores_the_old_one_when_the_rename_fails(tmp_path, monkeypatch):
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    out.mkdir()
    (out / "a").write_text("old")
    tmp.mkdir()
    real_rename = os.rename

    def rename(src, dst):
        if Path(src) == tmp:
            raise OSError(28, "No space left on device")
        return real_rename(src, dst)

    monkeypatch.setattr(atomic.os, "rename", rename)
    with pytest.raises(OSError, match="No space left"):
        atomic.replace_dir(tmp, out)
    assert (out / "a").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tmp"]


def test_replace_dir_over_a_file(tmp_path):
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    out.write_text("a file")
    tmp.mkdir()
    atomic.replace_dir(tmp, out)
    assert out.is_dir() and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_replace_dir_exclusive_installs_a_new_directory(tmp_path):
    out, tmp = tmp_path / "entry", tmp_path / "tmp"
    tmp.mkdir()
    (tmp / "a").write_text("new")
    atomic.replace_dir(tmp, out, exclusive=True)
    assert (out / "a").read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["entry"]


@pytest.mark.parametrize("existing", ["dir", "file"])
def test_replace_dir_exclusive_keeps_what_is_there(tmp_path, existing):
    """The first to install wins: the existing entry is neither replaced nor moved aside."""
    out, tmp = tmp_path / "entry", tmp_path / "tmp"
    if existing == "dir":
        out.mkdir()
        (out / "a").write_text("first")
    else:
        out.write_text("first")
    tmp.mkdir()
    (tmp / "a").write_text("second")
    with pytest.raises(FileExistsError):
        atomic.replace_dir(tmp, out, exclusive=True)
    assert ((out / "a") if existing == "dir" else out).read_text() == "first"
    assert (tmp / "a").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry", "tmp"]


def test_replace_dir_exclusive_loses_a_race_to_a_full_directory(tmp_path, monkeypatch):
    """``out`` appears, full, between the check and the rename: the rename's own refusal is a
    FileExistsError too."""
    out, tmp = tmp_path / "entry", tmp_path / "tmp"
    tmp.mkdir()
    (tmp / "a").write_text("second")
    real_rename = os.rename

    def rename(src, dst):
        out.mkdir()
        (out / "a").write_text("first")
        return real_rename(src, dst)

    monkeypatch.setattr(atomic.os, "rename", rename)
    with pytest.raises(FileExistsError):
        atomic.replace_dir(tmp, out, exclusive=True)
    assert (out / "a").read_text() == "first" and (tmp / "a").read_text() == "second"
