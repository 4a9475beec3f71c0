"""Files in and out, the way a room of forty laptops needs them: a bad file is one :class:`FileError` line
naming it, and :func:`write_atomic` renames a flushed temporary into place, so a kill at any moment
leaves the old file or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


class FileError(ValueError):
    """A file kvlab reads or writes is missing, unreadable, of the wrong kind, or cannot be written."""


def _reason(e: OSError) -> str:
    return e.strerror or type(e).__name__


def warn(message: str) -> None:
    """One line on stderr: kvlab recovered from something (e.g. rebuilt a corrupt cache file)."""
    print(f"kvlab: warning: {message}", file=sys.stderr, flush=True)


def read_bytes(path, what: str = "file", allow_empty: bool = False) -> bytes:
    """The bytes of a file that must exist, be a file, be readable and (by default) not be empty."""
    p = Path(path)
    if p.is_dir():
        raise FileError(f"{what} {str(p)!r} is a folder, not a file")
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise FileError(f"{what} {str(p)!r} does not exist") from None
    except OSError as e:
        raise FileError(f"{what} {str(p)!r} cannot be read: {_reason(e)}") from None
    if not data and not allow_empty:
        raise FileError(f"{what} {str(p)!r} is empty")
    return data


def read_text(path, what: str = "text file") -> str:
    """A UTF-8 text file's contents (an empty or whitespace-only file is an error)."""
    data = read_bytes(path, what)
    if b"\0" in data:
        raise FileError(f"{what} {str(path)!r} is a binary file (it holds NUL bytes), not text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FileError(f"{what} {str(path)!r} is not UTF-8 text (byte {e.start} is 0x{data[e.start]:02x}); "
                        "save it as UTF-8") from None
    if not text.strip():
        raise FileError(f"{what} {str(path)!r} holds only whitespace")
    return text


def read_json(path, what: str = "JSON file"):
    text = read_text(path, what)
    try:
        return json.loads(text)
    except ValueError as e:
        raise FileError(f"{what} {str(path)!r} is not valid JSON ({e})") from None


def _fsync_dir(folder: Path) -> None:
    try:  # make the rename itself durable; not possible on every OS / file system
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_all(f, data: bytes) -> None:
    f.write(data)


def write_atomic(path, data: bytes | str, what: str = "file") -> Path:
    """Write ``data`` to ``path`` through a temporary file and a rename, creating missing folders."""
    p = Path(path)
    if isinstance(data, str):
        data = data.encode("utf-8")
    check_writable_target(p, what)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FileError(f"cannot write {what} {str(p)!r}: its folder {str(p.parent)!r} cannot be created "
                        f"({_reason(e)})") from None
    _remove_dead_tmp(p)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            _write_all(f, data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except OSError as e:
        raise FileError(f"cannot write {what} {str(p)!r}: {_reason(e)}") from None
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(p.parent)
    return p


def pid_alive(pid: int) -> bool:
    """Whether a process with this id runs (to tell a killed writer's leftovers from a live one's)."""
    if pid == os.getpid() or os.name == "nt":  # (on Windows, signal 0 would be a Ctrl-C)
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. PermissionError: it exists
        return True
    return True


def _remove_dead_tmp(p: Path) -> None:
    """Temporary files of writers that were killed (``.<name>.<pid>.tmp``): never read, only clutter."""
    try:
        for t in p.parent.glob(f".{p.name}.*.tmp"):
            pid = t.name[len(p.name) + 2:-4]
            if pid.isdigit() and not pid_alive(int(pid)):
                t.unlink(missing_ok=True)
    except OSError:
        pass


def check_writable_target(path, what: str = "file") -> Path:
    """Fail before hours of work when ``path`` clearly cannot be written (a folder, a file as parent)."""
    p = Path(path)
    if p.is_dir():
        raise FileError(f"cannot write {what} {str(p)!r}: it is a folder")
    for parent in p.parents:
        if parent.exists():
            if not parent.is_dir():
                raise FileError(f"cannot write {what} {str(p)!r}: {str(parent)!r} is a file, not a folder")
            break
    return p
