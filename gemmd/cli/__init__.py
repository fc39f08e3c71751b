"""Command line: ``gemmd COMMAND [options]``.

=============  ==========================================================  ===========
command        what it does                                                module
=============  ==========================================================  ===========
run            the daemon: probe rounds, refits, /metrics                  daemon.py
check-config   validate a configuration                                    daemon.py
rebaseline     accept devices' current behaviour as their new normal       daemon.py
probe          one probe round on every device, printed                    probe.py
status         what the store holds: sources, devices, drift, the model    status.py
fit            fit the model on files or stored sources                    model.py
evaluate       gemmd's model vs GPPerf's pipeline on the same splits       model.py
predict        runtime, power, energy of one GEMM                          predict.py
advise         the fastest and most energy-efficient known configuration   predict.py
import         measurements into the store as a named source               data.py
export         stored results with their device, as CSV                    data.py
prune          delete stored results of one source                         data.py
report         predicted vs measured as figures, one HTML page             report.py
=============  ==========================================================  ===========

Beside them: args.py (argument types, choice lists, the options every command takes,
exit statuses, UsageError), context.py (configuration, logging, the store, GPUs and
data) and output.py (number, table and progress formatting).

Every expected failure (bad config, bad argument, missing device, unreadable store) ends in
one line per problem on stderr and a non-zero exit status, never a traceback: 2 for a
configuration or usage error, 1 for anything else (a device, store, file or probe).
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys
from collections.abc import Sequence
from typing import NoReturn

from gemmd import __version__
from gemmd.cli import daemon, data, model, predict, probe, report, status
from gemmd.cli.args import EXIT_CONFIG, EXIT_RUNTIME, UsageError, common_options
from gemmd.errors import ConfigError, GemmdError

__all__ = ["EXIT_CONFIG", "EXIT_RUNTIME", "UsageError", "build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2 (argparse's prints usage)
        self.exit(EXIT_CONFIG, _usage_line(message, self.prog.split()[-1]
                                           if " " in self.prog else None))


def _usage_line(message: str, command: str | None) -> str:
    see = f" (see gemmd {command} --help)" if command else ""
    return f"gemmd: error: {_one_line(message)}{see}\n"


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="gemmd", description="GEMM probes on every GPU, measured vs predicted, "
                                          "as Prometheus metrics.")
    p.add_argument("--version", action="version", version=f"gemmd {__version__}")
    # The common options work before the command (gemmd --state-dir X status) and after it
    # (gemmd status --state-dir X); after it wins. The copy on each command has no default,
    # so that not repeating an option there keeps what was given before the command.
    common_options(p, defaults=True)
    common = argparse.ArgumentParser(add_help=False)
    common_options(common, defaults=False)
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for group in (daemon, probe, status, model, predict, data, report):
        group.add_commands(sub, common)
    return p


def _one_line(text: str) -> str:
    """Escape line breaks and other control characters: one problem, one line."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rc = args.func(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        return rc
    except UsageError as e:
        sys.stderr.write(_usage_line(str(e), args.command))
        return EXIT_CONFIG
    except ConfigError as e:
        for problem in e.problems:
            print(f"gemmd: config error: {_one_line(e.source)}: {_one_line(problem)}",
                  file=sys.stderr)
        return EXIT_CONFIG
    except GemmdError as e:
        print(f"gemmd: error: {_one_line(str(e))}", file=sys.stderr)
        return EXIT_RUNTIME
    except sqlite3.Error as e:  # a store error that escaped translation: still one line
        print(f"gemmd: error: store: {_one_line(str(e))}", file=sys.stderr)
        return EXIT_RUNTIME
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # stdout closed early (gemmd export | head): nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error
        return EXIT_RUNTIME
