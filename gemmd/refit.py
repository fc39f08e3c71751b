"""A refit in a child process: its working set (the training table, the new forests, the
cross-validation fits, scikit-learn's temporaries: ~0.5-1 GB at the training cap) is the
child's, and goes back to the system when the child exits; the daemon keeps only the model
it loads from the file the child registered (bench/RESULTS.md, "Memory over a week").

The daemon (``RefitProcess``) starts ``python -m gemmd.refit``, writes the job to its
standard input as JSON (the state directory, the model section of the configuration, the
sources), and reads one JSON line back: the ``RefitResult``, or the error that ended the
refit. The child logs to the daemon's standard error (journald keeps both). It opens the
store with a connection of its own (SQLite in WAL mode: the daemon goes on writing), loads
the active model to compare the new one with, fits, and registers a better one exactly as
``ModelRegistry.refit`` does in a process. SIGTERM (the daemon stopping) ends the fit at
once; a model being registered is finished first, never left half-recorded.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from gemmd.config import ModelConfig
from gemmd.errors import GemmdError
from gemmd.registry import ModelRegistry, RefitResult

logger = logging.getLogger(__name__)


class RefitFailed(GemmdError):
    """A refit that ended in an error the child reported (the daemon logs it as such)."""

    def __init__(self, message: str, *, reported: bool = False):
        super().__init__(message)
        self.reported = reported


def error_text(e: BaseException) -> str:
    """One line for a refit's failure, naming the file where there is one."""
    if isinstance(e, OSError) and e.filename:
        return f"{e.strerror}: {e.filename}"
    return str(e)


# ------------------------------------------------------------------ the daemon's side


class RefitProcess:
    """Runs refits in child processes, one at a time; ``stop()`` ends the one running."""

    def __init__(self, state_dir: Path, model: ModelConfig, log_level: str = "info"):
        self.state_dir = Path(state_dir)
        self.model = model
        self.log_level = log_level
        self._lock = threading.Lock()
        self._child: subprocess.Popen | None = None
        self._stopping = False
        self.peak_mib: float | None = None  # the last child's peak RSS, as it reported it

    def run(self, sources: tuple[str, ...] = ("daemon",), force: bool = False) -> RefitResult:
        """One refit in a child; its result. RefitFailed if it failed (or died)."""
        job = {"state_dir": str(self.state_dir), "model": dataclasses.asdict(self.model),
               "sources": list(sources), "force": force, "log_level": self.log_level}
        with self._lock:
            if self._stopping:
                raise RefitFailed("the daemon is stopping", reported=True)
            child = self._child = subprocess.Popen(
                [sys.executable, "-m", "gemmd.refit"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=None, text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            out, _ = child.communicate(json.dumps(job))
        finally:
            with self._lock:
                self._child = None
        lines = [ln for ln in (out or "").splitlines() if ln.startswith("{")]
        if not lines:
            how = f"killed by signal {-child.returncode}" if child.returncode < 0 else \
                f"exit status {child.returncode}"
            raise RefitFailed(f"the refit process ended without a result ({how})",
                              reported=self._stopping)
        answer = json.loads(lines[-1])
        self.peak_mib = answer.get("peak_mib")
        if "result" in answer:
            return RefitResult(**answer["result"])
        raise RefitFailed(answer.get("error", "unknown error"),
                          reported=bool(answer.get("reported")))

    def stop(self, timeout: float) -> bool:
        """End the refit running (SIGTERM, then SIGKILL after ``timeout``); True if none is
        left. No refit starts after this."""
        with self._lock:
            self._stopping = True
            child = self._child
        if child is None or child.poll() is not None:
            return True
        child.terminate()
        try:
            child.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            child.kill()
            try:
                child.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                return False
        return True


# ------------------------------------------------------------------ the child


def peak_mib() -> float | None:
    """This process's peak RSS (VmHWM), MiB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class _ChildRegistry(ModelRegistry):
    """The registry of the child: a SIGTERM during the fit ends it at once; one that
    arrives while a model is being registered (file, then store record) waits for it."""

    registering = False

    def register(self, model: Any) -> int:
        _ChildRegistry.registering = True
        try:
            return super().register(model)
        finally:
            _ChildRegistry.registering = False


def _terminate(cancel: threading.Event):
    def handler(signum: int, frame: Any) -> None:
        cancel.set()
        if not _ChildRegistry.registering:
            raise SystemExit(128 + signum)
    return handler


def child_main(stdin: Any = None, stdout: Any = None) -> int:
    from gemmd.store import Store

    job = json.loads((stdin or sys.stdin).read())
    out = stdout or sys.stdout
    logging.basicConfig(
        level=getattr(logging, str(job.get("log_level", "info")).upper(), logging.INFO),
        format="%(levelname)s %(name)s: %(message)s" if os.environ.get("JOURNAL_STREAM")
        else "%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    cancel = threading.Event()
    signal.signal(signal.SIGTERM, _terminate(cancel))

    def answer(obj: dict) -> int:
        out.write(json.dumps({**obj, "peak_mib": peak_mib()}) + "\n")
        out.flush()
        return 0

    state_dir = Path(job["state_dir"])
    try:
        cfg = ModelConfig(**job["model"])
        store = Store(state_dir / "gemmd.db", check=False)
        try:
            registry = _ChildRegistry(store, state_dir / "models", cfg)
            quiet = logging.getLogger("gemmd.registry")
            level = quiet.level
            quiet.setLevel(logging.WARNING)  # "loaded model ...": the daemon's line, not ours
            try:
                registry.load_active()
            finally:
                quiet.setLevel(level)
            result = registry.refit(tuple(job["sources"]), force=bool(job["force"]),
                                    cancel=cancel)
        finally:
            store.close()
    except SystemExit:
        return answer({"error": "stopped", "reported": True})
    except (OSError, GemmdError) as e:
        return answer({"error": error_text(e), "reported": bool(getattr(e, "reported",
                                                                        False))})
    except Exception as e:
        if cancel.is_set():  # the stop's SystemExit, which C code it interrupted turned
            # into its own error (an extension's import: "ImportError: initialization
            # failed", under load in CI's fuzz of `gemmd run`): stopped, not a bug
            return answer({"error": "stopped", "reported": True})
        logger.exception("refit failed")  # a bug: its traceback in the log, one line for
        # the daemon
        return answer({"error": f"{type(e).__name__}: {e}", "reported": True})
    return answer({"result": dataclasses.asdict(result)})


if __name__ == "__main__":
    sys.exit(child_main())
