"""Read external GEMM measurements (GPPerf, B200, XLA, gemmd's generic CSV) into a Table.

Every loader converts to SI units on the way in (seconds, watts, joules) and gives each
row the DeviceInfo of the GPU it ran on, from the datasheet catalogue. Any bad value
is an InputError naming the file, the row (as a spreadsheet numbers it: the header is
row 1) and the column; a file is read whole or not at all.

reader.py holds what every format shares (the CSV file, the Table, the GPU lookups);
sources.py the published measurement sets; generic.py gemmd's generic CSV; formats.py
the format registry and the loader.
"""

from gemmd.datasets.formats import (
    FORMATS,
    SHARED,
    detect_format,
    load,
    load_shared,
    shared_data_dir,
)
from gemmd.datasets.reader import KNOWN_GPUS, Dataset, known_gpu, known_gpu_names

__all__ = [
    "FORMATS", "KNOWN_GPUS", "SHARED", "Dataset", "detect_format", "known_gpu",
    "known_gpu_names", "load", "load_shared", "shared_data_dir",
]
