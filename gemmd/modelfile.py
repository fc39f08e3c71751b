"""Bounds on a model file before it is read (issue 24).

A model file is a zip archive (gemmd's flat arrays; skops before). Its central directory
says how large each member inflates to, and zipfile stops a member there, so an archive can
be sized before any of it is inflated: a 400 KB file whose ``schema.json`` inflates to 400
MB loaded as a valid model (``gemmd predict --model`` peaked at 955 MB). gemmd writes its
models uncompressed (the archive is as large as what it holds); a model re-zipped with
compression shrinks a few times at most. Anything that would inflate to more than
``MAX_RATIO`` times its size (and more than ``FLOOR_BYTES``) is refused, and so is a file
larger than ``MAX_FILE_BYTES`` (a sparse file of GBs of nothing).
"""

from __future__ import annotations

import os
import stat
import zipfile
from pathlib import Path

from gemmd.errors import ModelError

MAX_FILE_BYTES = 2 << 30  # a forest of 100 trees x 3 targets at the largest leaf bound fits
MAX_RATIO = 20  # inflated / file size; gemmd's own files: 1.0
FLOOR_BYTES = 64 << 20  # small files may inflate to this much whatever the ratio
MAX_MEMBERS = 100_000


def _size(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError  # not reached


def archive_problem(path: str | Path) -> str | None:
    """Why ``path`` cannot be a model file by its size and archive directory, or None."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None  # the loader says what is missing
    if not stat.S_ISREG(st.st_mode):
        return None  # ditto (it refuses anything but a file)
    if st.st_size > MAX_FILE_BYTES:
        return f"is {_size(st.st_size)}, larger than any model ({_size(MAX_FILE_BYTES)})"
    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        return f"is not a model file (not a zip archive: {e})"
    if len(infos) > MAX_MEMBERS:
        return f"holds {len(infos):,} files, more than a model ({MAX_MEMBERS:,})"
    inflated = sum(i.file_size for i in infos)
    cap = max(FLOOR_BYTES, MAX_RATIO * st.st_size)
    if inflated > cap:
        return (f"would inflate to {_size(inflated)} from {_size(st.st_size)} (more than "
                f"{_size(cap)}): refused, not read (a zip bomb?)")
    return None


def check_archive(path: str | Path) -> None:
    """ModelError naming the file if ``archive_problem`` finds one."""
    problem = archive_problem(path)
    if problem is not None:
        raise ModelError(f"model file {path} {problem}")
