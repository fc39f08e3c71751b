"""gemmd's one error hierarchy; vendor errors are translated at one boundary, cause kept."""

from __future__ import annotations


class GemmdError(Exception):
    """Base of every error gemmd raises on purpose; its message is fit for a log line."""


class ConfigError(GemmdError):
    """The configuration is invalid; carries every problem found, each with its key path."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: " + "; ".join(problems))


class DeviceError(GemmdError):
    """A device failed (driver error, lost device, failed kernel)."""


class DeviceFault(DeviceError):
    """The device's context is unusable (a sticky CUDA error such as an illegal address):
    the process that holds it must end; a worker-process device starts a fresh one."""


class DeviceUnavailable(GemmdError):
    """A backend cannot be used on this host (no driver, no GPU, library missing)."""


class UnsupportedProbe(GemmdError):
    """The device cannot run this probe configuration (dtype, kernel, memory budget)."""


class StoreError(GemmdError):
    """The SQLite store cannot be opened or is from an unknown schema version."""


class ModelError(GemmdError):
    """A model file is missing, tampered with, truncated or incompatible."""


class InputError(GemmdError):
    """A file or argument given by the user is invalid (names the row/column or argument)."""


class ProbeCancelled(GemmdError):
    """Shutdown was requested while a probe was running; its result is discarded."""


def naming(e: OSError, path: object) -> OSError:
    """``e`` with the file it was about: a write that fails for a full disk (ENOSPC) or
    an I/O error carries no file name, and "No space left on device" alone does not say
    where."""
    if e.filename is not None:
        return e
    return type(e)(e.errno, e.strerror or str(e), str(path))
