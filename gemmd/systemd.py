"""systemd's notify protocol (sd_notify(3)): READY, STATUS, WATCHDOG, STOPPING.

No library: one datagram to $NOTIFY_SOCKET. Outside systemd both are no-ops.
"""

from __future__ import annotations

import logging
import os
import socket

logger = logging.getLogger(__name__)


def sd_notify(message: str) -> bool:
    """Send a systemd notification (READY=1, WATCHDOG=1, STOPPING=1...) if asked to."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]  # abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            s.sendall(message.encode())
        return True
    except OSError as e:
        logger.warning("systemd notify failed (%s): %s", message.split("=")[0], e)
        return False


def watchdog_interval() -> float | None:
    """Half of systemd's WatchdogSec, when it applies to this process."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2e6
    except ValueError:
        return None
