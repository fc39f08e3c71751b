"""Offline model commands: fit, evaluate, predict, advise, import, report."""

from __future__ import annotations

import argparse


def add_commands(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Register the model's subcommands on the main parser (none yet)."""
