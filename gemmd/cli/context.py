"""What a command runs in: its configuration (the file, changed by command-line options),
logging, the store of the configured state directory, the GPU catalogue (plus
``--gpu-spec`` files) and the data a model command reads (files or stored sources)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gemmd.cli.args import UsageError
from gemmd.config import Config, check, load
from gemmd.errors import GemmdError, InputError
from gemmd.files import shown

if TYPE_CHECKING:
    from gemmd.datasets import Dataset
    from gemmd.hardware import Catalogue
    from gemmd.store import Store


# ------------------------------------------------------------------ configuration


def load_config(args: argparse.Namespace) -> Config:
    """The configuration of --config, with --state-dir and --backend applied (checked)."""
    cfg = load(args.config)
    over: dict[str, Any] = {}
    if getattr(args, "state_dir", None) is not None:  # '' is refused, not the cwd
        over["state_dir"] = args.state_dir
    if getattr(args, "backend", None):
        over["backend"] = args.backend
    if over:
        cfg = checked(dataclasses.replace(cfg, **over), over)
    return cfg


def checked(cfg: Config, options: dict[str, Any]) -> Config:
    """A config changed by command-line options, checked by the rules of a file."""
    return check(cfg, "command line (" + ", ".join(
        f"{k}={shown(str(v), 60)}" for k, v in options.items()) + ")")


def setup_logging(level: str) -> None:
    # Under systemd, journald stamps time and priority itself.
    fmt = "%(levelname)s %(name)s: %(message)s" if os.environ.get("JOURNAL_STREAM") else \
        "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=getattr(logging, level.upper()), format=fmt, stream=sys.stderr,
                        force=True)
    logging.getLogger("apscheduler").setLevel(logging.WARNING)


# ------------------------------------------------------------------ the store


def store_path(cfg: Config) -> Path:
    return cfg.resolved_state_dir() / "gemmd.db"


def no_store(db: Path) -> GemmdError:
    """The one error for a command that reads a store nobody has made."""
    return GemmdError(f"no store at {db} (run gemmd run or gemmd import there first; see "
                      "state_dir, --state-dir)")


def open_store(cfg: Config) -> Store:
    """The store of the configured state directory, which gemmd run or import must have
    made (a command that only reads never creates an empty one)."""
    from gemmd.store import Store

    db = store_path(cfg)
    if not db.is_file():
        raise no_store(db)
    return Store(db)


def open_or_create_store(cfg: Config) -> Store:
    """The store of the configured state directory, created if needed (gemmd import)."""
    from gemmd.runtime import open_state_dir

    return open_state_dir(cfg)[1]


# ------------------------------------------------------------------ GPUs and data


def gpu_catalog(spec_files: Sequence[str]) -> tuple[Catalogue, list[str]]:
    """The GPU catalogue (gemmd/hardware.py) plus the GPUs of --gpu-spec FILEs, and the
    keys of those added GPUs."""
    from gemmd.hardware import CATALOGUE, SpecError, load_gpu_specs

    specs = []
    for path in spec_files:
        try:
            specs += load_gpu_specs(path, CATALOGUE)
        except SpecError as e:
            raise InputError(f"--gpu-spec {e}") from None
    return (CATALOGUE.with_specs(specs) if specs else CATALOGUE), [x.key for x in specs]


def load_dataset(args: argparse.Namespace, cfg: Config) -> Dataset:
    """The data of FILE arguments (args.files, args.format, args.gpu, args.gpu_spec) or of
    stored sources (args.source; default: the daemon's probes)."""
    from gemmd import datasets
    from gemmd.features import Table
    from gemmd.registry import training_data

    if args.files and args.source:
        raise UsageError("give input files or --source, not both")
    if args.files:
        return datasets.load(args.format, args.files, gpu=args.gpu,
                             catalog=gpu_catalog(args.gpu_spec)[0])
    sources = args.source or ["daemon"]
    store = open_store(cfg)
    try:
        rows, infos = training_data(store, sources)
    finally:
        store.close()
    if not rows:
        raise InputError(f"the store holds no usable rows for source {', '.join(sources)} "
                         "(see gemmd status; imports are named with gemmd import --name)")
    return datasets.Dataset("+".join(sources), Table.from_rows(rows, infos),
                            [f"store:{s}" for s in sources])
