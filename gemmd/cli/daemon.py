"""The daemon's commands: ``gemmd run``, ``gemmd check-config`` and ``gemmd rebaseline``
(a request the running daemon picks up)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import threading

from gemmd.cli.args import BACKENDS
from gemmd.cli.context import checked, load_config, open_store, setup_logging, store_path
from gemmd.config import load, warnings
from gemmd.errors import InputError


def cmd_check_config(args: argparse.Namespace) -> int:
    path = args.file if args.file is not None else args.config  # '' is a (bad) file name
    cfg = load(path)
    if cfg.model.reference:
        # Loaded as the daemon will load it: a file it would refuse is refused now.
        from gemmd.errors import ConfigError, ModelError
        from gemmd.model import ForestModel
        from gemmd.modelfile import check_archive

        ref = os.path.expanduser(cfg.model.reference)
        try:
            check_archive(ref)
            ForestModel.load(ref, cfg.model.reference_sha256.lower() or None)
        except ModelError as e:
            raise ConfigError(path or "<built-in defaults>", [f"model.reference: {e}"]) from e
    for w in warnings(cfg):
        print(f"gemmd: warning: {w}", file=sys.stderr)
    print(f"{path or '<built-in defaults>'}: OK")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    cfg = load_config(args)  # before importing the daemon: a bad file is one line
    if args.port is not None:
        cfg = checked(dataclasses.replace(cfg, listen=dataclasses.replace(
            cfg.listen, port=args.port)), {"--port": args.port})
    if args.web_config_file is not None:
        cfg = checked(dataclasses.replace(cfg, listen=dataclasses.replace(
            cfg.listen, web_config_file=args.web_config_file)),
            {"--web.config.file": args.web_config_file})
    setup_logging(args.log_level or cfg.log_level)
    for w in warnings(cfg):
        logging.getLogger("gemmd.config").warning("%s", w)
    from gemmd.daemon import Daemon

    daemon = Daemon(cfg, refit_process=True)  # a refit's working set goes with its process
    signal.signal(signal.SIGTERM, lambda s, f: daemon.request_stop(s))
    signal.signal(signal.SIGINT, lambda s, f: daemon.request_stop(s))
    try:
        daemon.start()
        daemon.run_forever()
    finally:
        clean = daemon.stop()
    if not clean or [t for t in threading.enumerate()
                     if t is not threading.main_thread() and not t.daemon and t.is_alive()]:
        # A hung probe thread would keep the interpreter alive forever; the store is
        # consistent (each result is its own transaction), so leave without waiting.
        logging.shutdown()
        os._exit(0)
    return 0


def cmd_rebaseline(args: argparse.Namespace) -> int:
    """Accept the current behaviour of devices as their new normal."""
    from gemmd import rebaseline

    cfg = load_config(args)
    db = store_path(cfg)
    store = open_store(cfg)
    try:
        known = store.devices()
        uuids: list[str] | None = None
        if args.device:
            uuids = []
            for sel in args.device:
                hit = [d["uuid"] for d in known if d["uuid"] == sel or str(d["idx"]) == sel]
                if not hit:
                    have = ", ".join(f"{d['idx']}={d['uuid']}" for d in known) or "none"
                    raise InputError(f"--device {sel}: no such device in {db} (known: {have})")
                uuids.extend(h for h in hit if h not in uuids)
        n = rebaseline.request(db.parent, store, uuids)
    finally:
        store.close()
    who = ", ".join(uuids) if uuids else "all devices"
    print(f"rebaseline {who}: {n} stored result(s) taken while drifting now count for "
          "training; a running daemon resets its drift references within 5 s (otherwise at "
          "its next start)")
    return 0


def add_commands(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    r = sub.add_parser("run", parents=[common], help="run the daemon")
    r.add_argument("--port", type=int, help="override listen.port (0: any free port)")
    r.add_argument("--web.config.file", dest="web_config_file", metavar="FILE",
                   help="TLS and basic auth: an exporter-toolkit web configuration file "
                        "(overrides listen.web_config_file)")
    r.add_argument("--backend", choices=BACKENDS)
    r.set_defaults(func=cmd_run)

    cc = sub.add_parser("check-config", parents=[common], help="validate a configuration")
    cc.add_argument("file", nargs="?", help="file to check (default: --config)")
    cc.set_defaults(func=cmd_check_config)

    rb = sub.add_parser("rebaseline", parents=[common],
                        help="accept devices' current behaviour as their new normal")
    rb.add_argument("--device", action="append", default=[],
                    help="index or UUID (repeatable; default: every device)")
    rb.set_defaults(func=cmd_rebaseline)
