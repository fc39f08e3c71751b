"""Installed size of each CUDA extra: the wheels the image's lock pins, unpacked.

Downloads (pip, no dependencies resolved: the lock already did) the CuPy and CUDA wheels that
requirements/image-<extra>.txt pins for this machine's platform and Python, then sums the
uncompressed size of every file in each wheel, i.e. what `pip install` puts on disk (less
the .pyc files it compiles). Wheels already in --cache are not fetched again.

    python bench/extra_sizes.py [--cache /tmp/gemmd-wheels] [--extra cuda12 --extra cuda13]
                                [--also nvidia-cufft-cu12==11.4.1.4 ...]

``--also`` sizes wheels the lock no longer has (to compare with what was dropped).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.markers import Marker

ROOT = Path(__file__).resolve().parent.parent
CUDA_PIN = re.compile(r"^((?:nvidia-|cuda-|cupy-)[a-z0-9-]+==[^ ;]+)(?: ; (.*))?$", re.M)


def pins(extra: str) -> list[str]:
    """The lock's CUDA pins whose environment marker holds on this machine."""
    text = (ROOT / "requirements" / f"image-{extra}.txt").read_text()
    found = [pin for pin, marker in CUDA_PIN.findall(text)
             if not pin.startswith("nvidia-ml-py") and (not marker or Marker(marker).evaluate())]
    return sorted(set(found))


def unpacked_mib(wheel: Path) -> float:
    with zipfile.ZipFile(wheel) as z:
        return sum(i.file_size for i in z.infolist()) / 2**20


def wheel_of(pin: str, cache: Path) -> Path:
    name, version = pin.split("==")
    prefix = f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}-"

    def cached() -> list[Path]:
        return [w for w in cache.glob("*.whl") if w.name.lower().startswith(prefix)]

    if not cached():
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--only-binary=:all:", "-d", str(cache), pin], check=True)
    return cached()[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, default=Path("/tmp/gemmd-wheels"))
    ap.add_argument("--extra", action="append", choices=("cuda12", "cuda13"))
    ap.add_argument("--also", action="append", default=[], metavar="NAME==VERSION")
    args = ap.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    for extra in args.extra or ["cuda12", "cuda13"]:
        total = 0.0
        print(f"| {extra}: wheel | MiB unpacked |\n|---|---:|")
        for pin in pins(extra):
            mib = unpacked_mib(wheel_of(pin, args.cache))
            total += mib
            print(f"| {pin} | {mib:,.1f} |")
        print(f"| **{extra} in all** | **{total:,.1f}** |\n")
    if args.also:
        print("| `[ctk]` only: wheel | MiB unpacked |\n|---|---:|")
    for pin in args.also:
        print(f"| {pin} (not in the lock) | {unpacked_mib(wheel_of(pin, args.cache)):,.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
