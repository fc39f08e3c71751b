"""What the commands' arguments share: exit statuses, the usage error, argument types and
choice lists (each list taken from the module that defines the vocabulary), and the
options every command takes."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gemmd.config import BACKENDS, Config
from gemmd.files import cannot_write_in, path_problem, shown
from gemmd.gemm import DATA_KERNELS, DTYPES, KERNELS, LAYOUTS

EXIT_RUNTIME = 1  # a device, store or listen failure, a bad file, a failed probe
EXIT_CONFIG = 2  # a configuration or usage error

__all__ = ["BACKENDS", "DATA_KERNELS", "DTYPES", "EXIT_CONFIG", "EXIT_RUNTIME", "KERNELS",
           "LAYOUTS", "LOG_LEVELS", "UsageError", "common_options", "data_options",
           "default_config", "finite", "format_choices", "gpu_spec_option", "int_range", "mnk",
           "model_out", "nonempty", "path_arg", "shown"]


class UsageError(Exception):
    """Arguments that parse but do not make sense together (``--all`` with ``--max-rows``,
    ``--kernel tiled`` without ``--tile``): one line and exit status 2, as argparse's own
    errors."""


def _config_choices(name: str) -> tuple[str, ...]:
    """The allowed values of a top-level configuration key (config.py declares them)."""
    field = next(f for f in dataclasses.fields(Config) if f.name == name)
    return tuple(field.metadata["choices"])


LOG_LEVELS = _config_choices("log_level")


def format_choices() -> tuple[str, ...]:
    """Formats of measurement files: "auto" (detected from the header) and gemmd.datasets's.
    Imported when the parser is built, not with this module (it brings numpy)."""
    from gemmd.datasets import FORMATS

    return ("auto", *FORMATS)


# ------------------------------------------------------------------ argument types


def mnk(what: str, example: str, hi: int = 1 << 20) -> Callable[[str], tuple[int, int, int]]:
    """An argparse type: "MxNxK", each a whole number in 1..hi, naming ``what``."""

    def parse(text: str) -> tuple[int, int, int]:
        try:
            m, n, k = (int(x) for x in text.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} {text!r} is not MxNxK, e.g. {example}"
                                             ) from None
        if min(m, n, k) < 1 or max(m, n, k) > hi:
            raise argparse.ArgumentTypeError(f"{what} {text!r}: each dimension must be 1..{hi}")
        return m, n, k

    parse.__name__ = what  # argparse names the type in its own messages
    return parse


def int_range(what: str, lo: int, hi: int) -> Callable[[str], int]:
    """An argparse type: an integer in [lo, hi], with a message naming ``what``."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} {text!r} is not an integer") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{what} {v} is outside {lo}..{hi}")
        return v

    parse.__name__ = what
    return parse


def finite(what: str) -> Callable[[str], float]:
    """An argparse type: a finite number (no nan, no inf, nothing beyond a double)."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} {shown(text)!r} is not a number") from None
        if not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"{what} {shown(text)}: not a finite number")
        return v

    parse.__name__ = what
    return parse


def nonempty(what: str) -> Callable[[str], str]:
    """An argparse type: any text but an empty (or blank) one."""

    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"{what} must not be empty")
        return text

    parse.__name__ = what
    return parse


def path_arg(what: str) -> Callable[[str], str]:
    """An argparse type: a file name that can exist (not blank, no NUL, within the name
    and path lengths Linux allows; stat() raises on the others instead of answering)."""

    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"{what} must not be empty")
        problem = path_problem(text)
        if problem:
            raise argparse.ArgumentTypeError(f"{what} {shown(text)}: {problem}")
        return text

    parse.__name__ = what
    return parse


def model_out(text: str) -> Path:
    """--out of fit: a new or regular file in an existing, writable directory (checked
    before a fit of minutes, not after; never a device node such as /dev/full)."""
    path = Path(path_arg("--out")(text))
    if path.exists() and not path.is_file():
        raise argparse.ArgumentTypeError(f"--out {text}: exists and is not a regular file")
    parent = path.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"--out {text}: {parent} is not a directory")
    why = cannot_write_in(parent)  # checked before a fit of minutes, not after
    if why:
        raise argparse.ArgumentTypeError(f"--out {text}: cannot write in {parent}: {why}")
    return path


# ------------------------------------------------------------------ common options


def default_config() -> str | None:
    """$GEMMD_CONFIG, else /etc/gemmd/gemmd.yaml if present, else built-in defaults."""
    env = os.environ.get("GEMMD_CONFIG")
    if env:
        return env
    return "/etc/gemmd/gemmd.yaml" if Path("/etc/gemmd/gemmd.yaml").is_file() else None


def common_options(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    """--config, --state-dir, --log-level. With ``defaults`` False they default to
    nothing at all, so that a command's copy keeps what was given before the command."""

    def default(v: Any) -> Any:
        return v if defaults else argparse.SUPPRESS

    parser.add_argument("-c", "--config", default=default(default_config()),
                        help="configuration file (default: $GEMMD_CONFIG, "
                             "/etc/gemmd/gemmd.yaml, else built-in defaults)")
    parser.add_argument("--state-dir", default=default(None),  # checked as state_dir is
                        help="override state_dir")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default=default(None))


def gpu_spec_option(p: argparse.ArgumentParser) -> None:
    """--gpu-spec FILE (repeatable): GPUs the catalogue lacks (context.gpu_catalog)."""
    p.add_argument("--gpu-spec", action="append", default=[], metavar="FILE",
                   type=path_arg("--gpu-spec"),
                   help="YAML/JSON file describing GPUs the catalogue lacks (name, "
                        "peak_tflops per dtype, bandwidth_gbs...; see docs/model.md)")


def data_options(p: argparse.ArgumentParser) -> None:
    """FILE... or --source NAME (the data of fit, evaluate and report), --jobs."""
    p.add_argument("files", nargs="*", metavar="FILE", type=path_arg("FILE"),
                   help="measurement files (default: the store, see --source)")
    p.add_argument("--format", choices=format_choices(), default="auto",
                   help="format of FILE (default: detected from the header)")
    p.add_argument("--gpu", type=nonempty("--gpu"),
                   help="GPU the rows ran on, for files without a GPU column (a file that "
                        "names its GPU and a different --gpu is an error): a catalogue key or "
                        "the name nvidia-smi prints, e.g. a100-sxm-80gb, 'NVIDIA L4'")
    gpu_spec_option(p)
    p.add_argument("--source", action="append", default=[], metavar="NAME",
                   help="store source to use (repeatable; default: daemon)")
    p.add_argument("--jobs", type=int_range("--jobs", 1, max(1, os.cpu_count() or 1) * 4),
                   default=1, help="CPU cores for fitting (default 1)")
