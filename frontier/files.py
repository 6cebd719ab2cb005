"""Writes that leave a whole file or none, and one sentence naming the file when the OS refuses one."""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Iterator

from frontier.config import error_line, raised_from


class RunWriteError(Exception):
    """A file of the run (resume.pt, summary.json) could not be written: one sentence naming it."""


def write_json(path: Path, content: dict) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(content, indent=2, default=str, allow_nan=False)))


def atomic_write(path: Path, write) -> None:
    """`write(tmp)` then rename over `path`; on failure no .tmp is left and one sentence names the file."""
    tmp = path.with_name(path.name + ".tmp")
    with writing(path, tmp):
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        os.replace(tmp, path)


@contextlib.contextmanager
def writing(path: Path, *temporaries: Path) -> Iterator[None]:
    """A failed write (full disk, unwritable folder) becomes RunWriteError naming `path`; whatever
    stops the write (a second signal too), the half-written `temporaries` are removed."""
    try:
        yield
    except BaseException as err:
        for tmp in temporaries:
            with contextlib.suppress(OSError):
                tmp.unlink()
        if not isinstance(err, (OSError, RuntimeError)):  # torch.save reports a failed write as a RuntimeError
            raise
        stop = interrupted_by(err)
        if stop is not None:  # a signal inside torch.save's write to the file: a stop, not a failed write
            raise stop
        raise RunWriteError(f"cannot write {path}: {write_failure(err)}") from None


def interrupted_by(err: BaseException) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt an error was raised while handling: torch.save writing to a Python file turns
    one raised inside the file's write() into "[enforce fail ...] unexpected pos", which would end a
    stopped run FAILED ("cannot write final.pt") rather than KILLED."""
    return next((cause for cause in raised_from(err) if isinstance(cause, KeyboardInterrupt)), None)


def write_failure(err: BaseException) -> str:
    """The OS's reason ("No space left on device") where the error or one it was raised from has one."""
    code = next((cause.errno for cause in raised_from(err) if isinstance(cause, OSError) and cause.errno), None)
    return os.strerror(code) if code else error_line(err, named=False)
