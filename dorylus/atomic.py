"""Files and directories that appear whole or not at all.

A file is written to a temporary name beside its target (same directory, so same file system),
flushed to disk, then renamed over the target: a reader, or the next run after a crash, sees the
old content or the new, never half of it, and a failure leaves no temporary file behind.
A directory is built the same way beside its target and swapped in with two renames (the old
one moved aside, then deleted), restored if the second rename fails.

Permissions: ``mode=None`` gives what ``open(path, "w")`` would (0666 less the umask); a
``mode`` is set exactly, and the temporary file has it from its creation, so a secret is never
readable by others even for a moment.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import IO, Any, Iterator


def _temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")


@contextlib.contextmanager
def writing(path: str | os.PathLike, *, mode: int | None = None, exclusive: bool = False) -> Iterator[IO[bytes]]:
    """A binary handle whose content replaces ``path`` when the block ends without an exception.

    ``exclusive=True`` refuses (FileExistsError) to replace a file that exists when the block
    ends, as ``open(path, "x")`` would, yet still never leaves a partial file.
    """
    path = Path(path)
    tmp = _temp_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else mode)
    try:
        with os.fdopen(fd, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)  # exactly, whatever the umask
            yield f
            f.flush()
            os.fsync(f.fileno())
        if exclusive:
            os.link(tmp, path)  # fails if path exists, unlike a rename
        else:
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_bytes(path: str | os.PathLike, data: bytes, *, mode: int | None = None, exclusive: bool = False) -> None:
    with writing(path, mode=mode, exclusive=exclusive) as f:
        f.write(data)


def write_text(path: str | os.PathLike, text: str, *, mode: int | None = None, exclusive: bool = False) -> None:
    write_bytes(path, text.encode(), mode=mode, exclusive=exclusive)


def write_json(path: str | os.PathLike, value: Any, *, indent: int | None = 2, mode: int | None = None) -> None:
    """``value`` as JSON with a final newline."""
    write_text(path, json.dumps(value, indent=indent) + "\n", mode=mode)


def temp_dir_beside(path: str | os.PathLike, *, mode: int | None = None) -> Path:
    """A new empty directory in ``path``'s directory, named after it: ``mode`` exactly, or what
    ``mkdir`` gives (0777 less the umask) with ``mode=None``."""
    path = Path(path)
    while True:
        tmp = _temp_name(path)
        try:
            os.mkdir(tmp, 0o777 if mode is None else 0o700)
            break
        except FileExistsError:
            continue
    if mode is not None:
        os.chmod(tmp, mode)
    return tmp


def replace_dir(tmp: str | os.PathLike, out: str | os.PathLike, *, exclusive: bool = False) -> None:
    """Rename the complete directory ``tmp`` to ``out``: an existing ``out`` is moved aside
    first and deleted once ``tmp`` is in place, or moved back if that rename fails.

    ``exclusive=True`` refuses (FileExistsError) to replace an ``out`` that exists, leaving both
    as they are, and never moves ``out`` aside: for a cache shared by processes, where the first
    to install an entry wins and a reader must never find it missing. (Between the check and the
    rename, an *empty* directory made at ``out`` would still be replaced: ``rename(2)`` does that
    and Python has no ``RENAME_NOREPLACE``; a non-empty one is refused by the rename itself.)"""
    tmp, out = Path(tmp), Path(out)
    if not (out.exists() or out.is_symlink()):
        try:
            os.rename(tmp, out)
        except OSError as exc:
            if exclusive and exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise FileExistsError(errno.EEXIST, "directory exists", str(out)) from None
            raise
        return
    if exclusive:
        raise FileExistsError(errno.EEXIST, "directory exists", str(out))
    old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink(missing_ok=True)


@contextlib.contextmanager
def building_dir(out: str | os.PathLike, *, mode: int | None = None) -> Iterator[Path]:
    """A temporary directory beside ``out`` (:func:`temp_dir_beside`) to fill; it replaces
    ``out`` (:func:`replace_dir`) when the block ends without an exception, and is deleted in
    any case."""
    tmp = temp_dir_beside(out, mode=mode)
    try:
        yield tmp
        replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
