"""What GPU hardware can do: a catalogue of GPUs from their datasheets, name matching that
tolerates what NVML and tools print, user-described GPUs, and dense peak rates from compute
capability, SM count and clock. No CUDA: used by the NVIDIA backend, the daemon (to enrich
what NVML says with datasheet figures) and the importers of public measurements alike.

Conventions of the catalogue (every entry names its source):

- Peak rates are **dense** (no structured sparsity): datasheets that quote tensor rates
  "with sparsity" are halved. fp16/bf16/fp8 are tensor-core rates with **FP32
  accumulation** (cuBLAS's compute type for gemmd's fp16/bf16 probes); GeForce cards run
  those at half their FP16-accumulate rate. fp64 is the FP64 tensor-core rate where the
  GPU has one (A100, A30, H100/H200, B200: what DGEMM reaches), else the vector rate;
  fp64 figures marked "derived" are not on the datasheet (1/32 or 1/64 of fp32 by
  architecture). tf32 is absent on GPUs without TF32 tensor cores (V100, T4).
- Memory bandwidth is the datasheet's peak, power the board's default limit (TDP).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gemmd.errors import ConfigError
from gemmd.files import read_file, read_yaml  # the hardened reader of gemmd.yaml
from gemmd.gemm import DTYPES
from gemmd.records import DeviceInfo

# Dense FLOP per clock per SM by compute capability (tensor cores where the dtype uses
# them). Multiplied by SM count and max SM clock they give datasheet-level peaks, e.g.
# H100 SXM: 132 SMs x 1.98 GHz x 4096 = 1070 TFLOP/s bf16 (datasheet 989 at 1.83 GHz).
# Used for GPUs the catalogue does not know; enrich_device_info() prefers the catalogue.
_PER_SM_CLOCK = {
    (7, 0): {"fp64": 64, "fp32": 128, "fp16": 1024},
    (7, 5): {"fp64": 4, "fp32": 128, "fp16": 512},
    (8, 0): {"fp64": 128, "fp32": 128, "tf32": 1024, "fp16": 2048, "bf16": 2048},
    (8, 6): {"fp64": 4, "fp32": 256, "tf32": 512, "fp16": 1024, "bf16": 1024},
    (8, 7): {"fp64": 4, "fp32": 256, "tf32": 512, "fp16": 1024, "bf16": 1024},
    (8, 9): {"fp64": 4, "fp32": 256, "tf32": 512, "fp16": 1024, "bf16": 1024, "fp8": 2048},
    (9, 0): {"fp64": 256, "fp32": 256, "tf32": 2048, "fp16": 4096, "bf16": 4096,
             "fp8": 8192},
    (10, 0): {"fp64": 256, "fp32": 256, "tf32": 4096, "fp16": 8192, "bf16": 8192,
              "fp8": 16384},
    (12, 0): {"fp64": 4, "fp32": 256, "tf32": 512, "fp16": 1024, "bf16": 1024, "fp8": 2048},
}


def arch_rates(cc: tuple[int, int]) -> dict[str, int]:
    """Per-SM rates of ``cc``, or of the nearest older known architecture."""
    known = sorted(k for k in _PER_SM_CLOCK if k <= tuple(cc)) or [min(_PER_SM_CLOCK)]
    return _PER_SM_CLOCK[known[-1]]


def peak_flops(cc: tuple[int, int], sm_count: int, sm_clock_hz: float) -> dict[str, float]:
    """Dense peak FLOP/s per dtype."""
    return {d: v * sm_count * sm_clock_hz for d, v in arch_rates(cc).items()}


def bandwidth(bus_width_bits: int | None, max_mem_clock_hz: float | None) -> float:
    """Peak DRAM bandwidth, bytes/s: bus width x memory clock x 2 (double data rate)."""
    if not bus_width_bits or not max_mem_clock_hz:
        return 0.0
    return bus_width_bits / 8 * max_mem_clock_hz * 2


# ------------------------------------------------------------------ the catalogue


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model: datasheet figures in the units datasheets use."""

    key: str  # what --gpu takes, e.g. "a100-sxm-80gb"
    name: str  # as NVML prints it, e.g. "NVIDIA A100-SXM4-80GB"
    peak_tflops: dict[str, float]  # dense, per dtype (see the module's conventions)
    bandwidth_gbs: float  # peak memory bandwidth, GB/s (1e9 bytes/s)
    power_w: float | None = None  # board power limit (TDP)
    memory_gb: float | None = None
    sm_count: int | None = None  # SMs (CUs on AMD)
    boost_mhz: float | None = None
    cc: tuple[int, int] | None = None  # CUDA compute capability
    vendor: str = "nvidia"
    form: str = ""  # sxm | pcie | nvl | "" (one form only)
    source: str = ""  # the datasheet the figures come from
    aliases: tuple[str, ...] = ()

    @property
    def peak_flops(self) -> dict[str, float]:
        return {d: v * 1e12 for d, v in self.peak_tflops.items() if v}

    @property
    def mem_bandwidth(self) -> float:
        return self.bandwidth_gbs * 1e9

    def info(self, uuid: str | None = None) -> DeviceInfo:
        """A reference DeviceInfo (backend "reference") with these figures."""
        extra: dict[str, Any] = {"vendor": self.vendor, "key": self.key,
                                 "source": self.source}
        if self.cc:
            extra["compute_capability"] = f"{self.cc[0]}.{self.cc[1]}"
        if self.boost_mhz:
            extra["sm_clock_hz"] = self.boost_mhz * 1e6
        return DeviceInfo(index=0, uuid=uuid or f"ref-{self.key}", name=self.name,
                          backend="reference", peak_flops=self.peak_flops,
                          mem_bandwidth=self.mem_bandwidth, sm_count=self.sm_count,
                          memory_bytes=int(self.memory_gb * (1 << 30)) if self.memory_gb
                          else None, power_limit_w=self.power_w, extra=extra)


def _nv(key: str, name: str, cc: tuple[int, int], sms: int | None, mhz: float | None,
        fp64: float | None, fp32: float, tf32: float | None, fp16: float | None,
        fp8: float | None, bw: float, mem: float, power: float, source: str,
        form: str = "", bf16: float | None = -1.0, aliases: tuple[str, ...] = ()) -> GpuSpec:
    """An NVIDIA entry; bf16 defaults to the fp16 rate (None: no bf16)."""
    rates = {"fp64": fp64, "fp32": fp32, "tf32": tf32, "fp16": fp16,
             "bf16": fp16 if bf16 == -1.0 else bf16, "fp8": fp8}
    return GpuSpec(key, name, {d: v for d, v in rates.items() if v}, bw, power, mem, sms, mhz,
                   cc, "nvidia", form, source, aliases)


_V100 = "NVIDIA Tesla V100 datasheet (2020); fp16 = Tensor Core rate"
_A100 = "NVIDIA A100 Tensor Core GPU datasheet; tensor rates halved from 'with sparsity'"
_H100 = "NVIDIA H100 Tensor Core GPU datasheet; tensor rates halved from 'with sparsity'"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet; tensor rates halved from 'with sparsity'"
_ADA = ("NVIDIA Ada Lovelace architecture whitepaper, GeForce table (FP32-accumulate tensor "
        "rates); fp64 derived (1/64 fp32)")

# Ordered: the first entry of a family (a100, h100, v100...) is the one a bare family
# name ("A100", "H100") means.
_ENTRIES: tuple[GpuSpec, ...] = (
    # ---- Volta (7.0)
    _nv("v100-sxm2-32gb", "Tesla V100-SXM2-32GB", (7, 0), 80, 1530, 7.8, 15.7, None, 125,
        None, 900, 32, 300, _V100, "sxm", bf16=None),
    _nv("v100-sxm2-16gb", "Tesla V100-SXM2-16GB", (7, 0), 80, 1530, 7.8, 15.7, None, 125,
        None, 900, 16, 300, _V100, "sxm", bf16=None),
    _nv("v100-pcie-32gb", "Tesla V100-PCIE-32GB", (7, 0), 80, 1380, 7.0, 14.0, None, 112,
        None, 900, 32, 250, _V100, "pcie", bf16=None),
    _nv("v100-pcie-16gb", "Tesla V100-PCIE-16GB", (7, 0), 80, 1380, 7.0, 14.0, None, 112,
        None, 900, 16, 250, _V100, "pcie", bf16=None),
    _nv("v100s-pcie", "Tesla V100S-PCIE-32GB", (7, 0), 80, 1597, 8.2, 16.4, None, 130,
        None, 1134, 32, 250, "NVIDIA V100S datasheet; fp16 = Tensor Core rate", "pcie",
        bf16=None),
    # ---- Turing (7.5)
    _nv("t4", "Tesla T4", (7, 5), 40, 1590, 0.25, 8.1, None, 65, None, 320, 16, 70,
        "NVIDIA T4 datasheet (mixed-precision FP16/FP32 65 TFLOPS); fp64 derived (1/32)",
        bf16=None, aliases=("nvidiat4",)),
    # ---- Ampere (8.0 / 8.6)
    _nv("a100-sxm-80gb", "NVIDIA A100-SXM4-80GB", (8, 0), 108, 1410, 19.5, 19.5, 156, 312,
        None, 2039, 80, 400, _A100, "sxm"),
    _nv("a100-sxm-40gb", "NVIDIA A100-SXM4-40GB", (8, 0), 108, 1410, 19.5, 19.5, 156, 312,
        None, 1555, 40, 400, _A100, "sxm"),
    _nv("a100-pcie-80gb", "NVIDIA A100 80GB PCIe", (8, 0), 108, 1410, 19.5, 19.5, 156, 312,
        None, 1935, 80, 300, _A100, "pcie"),
    _nv("a100-pcie-40gb", "NVIDIA A100-PCIE-40GB", (8, 0), 108, 1410, 19.5, 19.5, 156, 312,
        None, 1555, 40, 250, _A100, "pcie"),
    _nv("a30", "NVIDIA A30", (8, 0), 56, 1440, 10.3, 10.3, 82, 165, None, 933, 24, 165,
        "NVIDIA A30 datasheet; tensor rates halved from 'with sparsity'"),
    _nv("a2", "NVIDIA A2", (8, 6), 10, 1770, 0.07, 4.5, 9, 18, None, 200, 16, 60,
        "NVIDIA A2 datasheet (40-60 W); fp64 derived (1/64)"),
    _nv("a10", "NVIDIA A10", (8, 6), 72, 1695, 0.49, 31.2, 62.5, 125, None, 600, 24, 150,
        "NVIDIA A10 datasheet; fp64 derived (1/64)"),
    _nv("a16", "NVIDIA A16", (8, 6), 10, 1755, 0.07, 4.5, 9, 17.9, None, 200, 16, 62.5,
        "NVIDIA A16 datasheet, one of its 4 GPUs (board figures / 4, 250 W board); fp64 "
        "derived (1/64)"),
    _nv("a40", "NVIDIA A40", (8, 6), 84, 1740, 0.58, 37.4, 74.8, 149.7, None, 696, 48, 300,
        "NVIDIA A40 datasheet; fp64 derived (1/64)"),
    _nv("rtx-a6000", "NVIDIA RTX A6000", (8, 6), 84, 1800, 0.6, 38.7, 77.4, 154.8, None,
        768, 48, 300, "NVIDIA RTX A6000 datasheet (tensor 309.7 TFLOPS with sparsity); fp64 "
        "derived (1/64)"),
    # ---- Ada Lovelace (8.9)
    _nv("l4", "NVIDIA L4", (8, 9), 58, 2040, 0.47, 30.3, 60, 121, 242.5, 300, 24, 72,
        "NVIDIA L4 datasheet; tensor rates halved from 'with sparsity'; fp64 derived"),
    _nv("l40", "NVIDIA L40", (8, 9), 142, 2490, 1.41, 90.5, 90.5, 181, 362, 864, 48, 300,
        "NVIDIA L40 datasheet (FP32-accumulate dense rates); fp64 derived"),
    _nv("l40s", "NVIDIA L40S", (8, 9), 142, 2520, 1.43, 91.6, 183, 362, 733, 864, 48, 350,
        "NVIDIA L40S datasheet; tensor rates halved from 'with sparsity'; fp64 derived"),
    _nv("rtx4070", "NVIDIA GeForce RTX 4070", (8, 9), 46, 2475, 0.455, 29.1, 29.1, 58.3,
        116.6, 504, 12, 200, "NVIDIA GeForce RTX 4070 specifications (5888 CUDA cores, 2.475 "
        "GHz); tensor rates per SM as the Ada whitepaper's GeForce table; fp64 derived"),
    _nv("rtx4090", "NVIDIA GeForce RTX 4090", (8, 9), 128, 2520, 1.29, 82.6, 82.6, 165.2,
        330.3, 1008, 24, 450, _ADA),
    _nv("rtx6000-ada", "NVIDIA RTX 6000 Ada Generation", (8, 9), 142, 2505, 1.42, 91.1,
        182.1, 364.2, 728.5, 960, 48, 300, "NVIDIA RTX 6000 Ada datasheet (1457 TFLOPS FP8 "
        "with sparsity); fp64 derived"),
    # ---- Hopper (9.0)
    _nv("h100-sxm", "NVIDIA H100 80GB HBM3", (9, 0), 132, 1980, 67, 67, 494.5, 989.5, 1979,
        3350, 80, 700, _H100, "sxm", aliases=("sm90", "nvidiah100sxmsm90", "nvidiah100sxm",
                                              "h100sxm5", "hbm3")),
    _nv("h100-pcie", "NVIDIA H100 PCIe", (9, 0), 114, 1755, 51, 51, 378, 756.5, 1513, 2000,
        80, 350, _H100, "pcie"),
    _nv("h100-nvl", "NVIDIA H100 NVL", (9, 0), 132, 1785, 60, 60, 417.5, 835.5, 1670.5,
        3900, 94, 400, _H100, "nvl"),
    _nv("h20", "NVIDIA H20", (9, 0), 78, 1980, 1, 44, 74, 148, 296, 4000, 96, 400,
        "NVIDIA HGX H20 product brief as reported (no public datasheet): dense rates"),
    _nv("h200", "NVIDIA H200", (9, 0), 132, 1980, 67, 67, 494.5, 989.5, 1979, 4800, 141,
        700, _H200, "sxm"),
    _nv("h200-nvl", "NVIDIA H200 NVL", (9, 0), 132, 1785, 60, 60, 417.5, 835.5, 1670.5,
        4800, 141, 600, _H200, "nvl"),
    # ---- Blackwell (10.x)
    _nv("b200", "NVIDIA B200", (10, 0), 148, 1965, 37, 75, 1125, 2250, 4500, 8000, 180,
        1000, "NVIDIA HGX B200 datasheet, 8-GPU figures / 8; tensor rates halved from "
        "'with sparsity'", aliases=("sm100", "sm100b200", "b200sxm192gb", "b200sxm")),
    _nv("b300", "NVIDIA B300 SXM6 AC", (10, 3), None, None, 1.25, 75, 1125, 2250, 4500,
        8000, 270, 1100, "NVIDIA HGX B300 datasheet, 8-GPU figures / 8; tensor rates halved "
        "from 'with sparsity'"),
    _nv("gb200", "NVIDIA GB200", (10, 0), None, None, 40, 80, 1250, 2500, 5000, 8000, 186,
        1200, "NVIDIA GB200 NVL72 datasheet, 72-GPU figures / 72; tensor rates halved from "
        "'with sparsity'"),
    _nv("gb300", "NVIDIA GB300", (10, 3), None, None, 1.39, 80, 1250, 2500, 5000, 8000, 279,
        1400, "NVIDIA GB300 NVL72 datasheet, 72-GPU figures / 72; tensor rates halved from "
        "'with sparsity'"),
    # ---- AMD Instinct
    GpuSpec("mi300x", "AMD Instinct MI300X", {"fp64": 163.4, "fp32": 163.4, "tf32": 653.7,
                                              "fp16": 1307.4, "bf16": 1307.4, "fp8": 2614.9},
            5300, 750, 192, 304, 2100, None, "amd", "", "AMD Instinct MI300X datasheet "
            "(dense matrix rates)", ("gfx942",)),
    GpuSpec("mi325x", "AMD Instinct MI325X", {"fp64": 163.4, "fp32": 163.4, "tf32": 653.7,
                                              "fp16": 1307.4, "bf16": 1307.4, "fp8": 2614.9},
            6000, 1000, 256, 304, 2100, None, "amd", "", "AMD Instinct MI325X datasheet "
            "(dense matrix rates)"),
    # gfx950 has no TF32 units; XLA's f32 GEMMs reach 1.0 PFLOP/s there (reduced-precision
    # passes), so its "tf32" entry is half the bf16 rate, which keeps every XLA f32 row
    # below its roofline.
    GpuSpec("mi355x", "AMD Instinct MI355X", {"fp64": 78.6, "fp32": 157.3, "tf32": 1250,
                                              "fp16": 2500, "bf16": 2500, "fp8": 5000},
            8000, 1400, 288, 256, 2400, None, "amd", "", "AMD Instinct MI355X datasheet "
            "(dense); tf32 = half the bf16 rate (no TF32 units, see gemmd/hardware.py)",
            ("gfx950", "amdinstinctmi355xgfx950")),
)

# Words that name a vendor, a brand or nothing in particular.
_NOISE = {"nvidia", "tesla", "geforce", "amd", "instinct", "radeon", "graphics", "gpu",
          "generation", "accelerator", "tensor", "core", "ac", "oam", "module", "board",
          "card"}
_FORMS = (("sxm", "sxm"), ("pcie", "pcie"), ("pci", "pcie"), ("nvl", "nvl"))
_MEMTYPES = {"hbm", "hbm2", "hbm2e", "hbm3", "hbm3e", "gddr6", "gddr6x", "gddr7"}


def compact(name: str) -> str:
    """Lower case, letters and digits only: 'Tesla V100-PCIE-32GB' -> 'teslav100pcie32gb'."""
    return re.sub(r"[^a-z0-9]", "", name.lower())


def parse_name(name: str) -> tuple[str, str, float | None, set[str]]:
    """(family, form, memory GB, hints) of a GPU name as NVML or a tool prints it.

    'NVIDIA A100-SXM4-80GB' -> ('a100', 'sxm', 80, {}); 'NVIDIA H100 80GB HBM3' ->
    ('h100', '', 80, {'hbm3'}); 'NVIDIA RTX 6000 Ada Generation' -> ('rtx6000ada', ...);
    'a100-pcie-40' -> ('a100', 'pcie', 40, {}) (a bare number after a model number is its
    memory).
    A MIG suffix ('... MIG 1g.10gb') is ignored.
    """
    text = re.split(r"\bmig\b", name.lower())[0]
    tokens = [t for t in re.split(r"[^a-z0-9]+", text) if t]
    family: list[str] = []
    form, mem, hints = "", None, set()
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        m = re.fullmatch(r"(\d+)gb", tok)
        if m or (tok.isdigit() and i + 1 < len(tokens) and tokens[i + 1] == "gb"):
            mem = float(m[1] if m else tok)
            i += 1 if m else 2
            continue
        if tok.isdigit() and family and any(c.isdigit() for c in family[-1]) \
                and 4 <= int(tok) <= 512:
            mem = float(tok)  # 'a100-80', 'v100_16': a size after a model number
            i += 1
            continue
        f = next((v for p, v in _FORMS if re.fullmatch(p + r"\d*(express)?", tok)), None)
        if f:
            form = f
        elif tok in _MEMTYPES:
            hints.add(tok)
        elif tok not in _NOISE:
            family.append(tok)
        i += 1
    return "".join(family), form, mem, hints


class Catalogue:
    """GPU specs by key, with name matching; user specs are added with ``with_specs``."""

    def __init__(self, specs: Iterable[GpuSpec]):
        self.specs: dict[str, GpuSpec] = {}
        self._alias: dict[str, str] = {}
        self._family: dict[str, list[str]] = {}
        self._infos: dict[str, DeviceInfo] = {}
        for s in specs:
            self._add(s)

    def _add(self, s: GpuSpec, first: bool = False) -> None:
        old = self.specs.get(s.key)
        if old is not None:  # replaced: forget the old entry's family place
            fam = self._family.get(parse_name(old.name)[0], [])
            if s.key in fam:
                fam.remove(s.key)
        self.specs[s.key] = s
        for a in (s.key, s.name, *s.aliases):
            if a not in _MEMTYPES:
                self._alias[compact(a)] = s.key
        fam = self._family.setdefault(parse_name(s.name)[0], [])
        fam.insert(0, s.key) if first else fam.append(s.key)
        self._infos.pop(s.key, None)

    def with_specs(self, specs: Iterable[GpuSpec]) -> Catalogue:
        """A catalogue with ``specs`` added; a user spec with a known key or name wins (and
        comes first among its family: 'A100' then means the user's A100)."""
        out = Catalogue(())
        out.specs, out._alias = dict(self.specs), dict(self._alias)
        out._family = {k: list(v) for k, v in self._family.items()}
        out._infos = dict(self._infos)
        for s in specs:
            out._add(s, first=True)
        return out

    def keys(self) -> list[str]:
        return list(self.specs)

    def lookup(self, name: str) -> GpuSpec | None:
        """The spec a GPU name means: a key, an alias, or a name as NVML, nvidia-smi,
        XLA or a spreadsheet prints it ('NVIDIA A100-SXM4-80GB', 'Tesla V100-PCIE-32GB',
        'NVIDIA H100 80GB HBM3', 'NVIDIA GeForce RTX 4090', 'a100', 'sm_90'); None if
        unknown. Case, punctuation, vendor words and MIG suffixes are ignored; a bare
        family ('A100') means its first entry (SXM, largest memory)."""
        if not name or not name.strip():
            return None
        key = self._alias.get(compact(name))
        if key:
            return self.specs[key]
        family, form, mem, hints = parse_name(name)
        cands = [self.specs[k] for k in self._family.get(family, [])]
        if not cands:
            return None
        if form:
            cands = [s for s in cands if s.form in (form, "")] or cands
        if mem:
            near = [s for s in cands if s.memory_gb and abs(s.memory_gb - mem) <= 0.15 * mem]
            cands = near or cands
        if hints:
            hinted = [s for s in cands if hints & set(s.aliases)]
            cands = hinted or cands
        return cands[0]

    def info(self, name: str) -> DeviceInfo | None:
        """The reference DeviceInfo of a GPU name (the same object for every spelling)."""
        spec = self.lookup(name)
        return None if spec is None else self.info_of(spec.key)

    def info_of(self, key: str) -> DeviceInfo:
        """The reference DeviceInfo of a key of this catalogue (KeyError if none)."""
        if key not in self._infos:
            self._infos[key] = self.specs[key].info()
        return self._infos[key]

    def names(self) -> str:
        """The keys, for error messages."""
        return ", ".join(self.specs)


CATALOGUE = Catalogue(_ENTRIES)


def lookup(name: str) -> GpuSpec | None:
    """CATALOGUE.lookup: the datasheet spec of a GPU name, or None."""
    return CATALOGUE.lookup(name)


def enrich_device_info(info: DeviceInfo, catalogue: Catalogue | None = None) -> DeviceInfo:
    """``info`` (from NVML) with the catalogue's datasheet figures when its name matches.

    Peak FLOP/s per dtype and memory bandwidth come from the datasheet (dtypes the
    catalogue lacks keep the clock-derived value), so that the daemon's probes and
    offline data (which only have datasheets) describe a GPU model the same way; SM
    count, memory and the power limit NVML reports are kept (the power limit an operator
    set is what power is learned against), the catalogue fills what NVML left empty.
    The clock-derived figures stay in ``extra`` ("peak_flops_clock",
    "mem_bandwidth_clock"); ``extra["catalogue"]`` names the entry. Unmatched names
    (CPUs, fake devices, GPUs the catalogue lacks) come back unchanged.
    """
    spec = (catalogue or CATALOGUE).lookup(info.name)
    if spec is None or info.extra.get("catalogue") == spec.key:
        return info
    extra = {**info.extra, "catalogue": spec.key, "catalogue_source": spec.source,
             "peak_flops_clock": dict(info.peak_flops),
             "mem_bandwidth_clock": info.mem_bandwidth}
    return dataclasses.replace(
        info, peak_flops={**info.peak_flops, **spec.peak_flops},
        mem_bandwidth=spec.mem_bandwidth, sm_count=info.sm_count or spec.sm_count,
        memory_bytes=info.memory_bytes or (int(spec.memory_gb * (1 << 30))
                                           if spec.memory_gb else None),
        power_limit_w=info.power_limit_w or spec.power_w, extra=extra)


def gpu_model_key(info: DeviceInfo) -> str:
    """What identifies a GPU *model* (not one card): the catalogue key if the name or the
    info says one, else the name in compact form. Eight H100s on a host share one."""
    key = info.extra.get("catalogue") or info.extra.get("key")
    if key:
        return str(key)
    spec = CATALOGUE.lookup(info.name)
    return spec.key if spec else compact(info.name) or info.uuid


# ------------------------------------------------------------------ user-described GPUs

SPEC_FIELDS = {"key", "name", "base", "peak_tflops", "bandwidth_gbs", "power_w", "memory_gb",
               "sm_count", "boost_mhz", "compute_capability", "vendor", "form", "source",
               "aliases"}


class SpecError(ValueError):
    """A GPU spec file or record that cannot be used (message names the field)."""


def spec_from_mapping(d: Mapping[str, Any], where: str, catalogue: Catalogue | None = None
                      ) -> GpuSpec:
    """A GpuSpec from a mapping (one entry of a --gpu-spec file).

    ``name`` is required; ``base`` (a catalogue GPU) supplies every figure not given, e.g.
    a card run at a lower clock: ``{name: "A100 at 1.1 GHz", base: a100-sxm-80gb,
    peak_tflops: {bf16: 243}}``. Without ``base``, ``peak_tflops`` (TFLOP/s per dtype,
    dense) and ``bandwidth_gbs`` are required.
    """
    cat = catalogue or CATALOGUE
    if not isinstance(d, Mapping):
        raise SpecError(f"{where}: expected a mapping of fields, got {type(d).__name__}")
    unknown = sorted(set(d) - SPEC_FIELDS)
    if unknown:
        raise SpecError(f"{where}: unknown field{'s' if len(unknown) > 1 else ''} "
                        f"{', '.join(map(str, unknown))} (known: {', '.join(sorted(SPEC_FIELDS))})")
    name = d.get("name")
    if not isinstance(name, str) or not name.strip():
        raise SpecError(f"{where}: name: a GPU needs a name (as nvidia-smi prints it)")
    base = None
    if d.get("base") is not None:
        base = cat.lookup(str(d["base"]))
        if base is None:
            raise SpecError(f"{where}: base: unknown GPU {d['base']!r} (known: {cat.names()})")
    peaks = dict(base.peak_tflops) if base else {}
    raw = d.get("peak_tflops")
    if raw is not None:
        if not isinstance(raw, Mapping):
            raise SpecError(f"{where}: peak_tflops: expected a mapping dtype: TFLOP/s")
        for k, v in raw.items():
            if k not in DTYPES:
                raise SpecError(f"{where}: peak_tflops.{k}: not a dtype ({', '.join(DTYPES)})")
            peaks[k] = _positive(v, f"{where}: peak_tflops.{k}", allow_none=True)
    peaks = {k: v for k, v in peaks.items() if v}
    if not peaks:
        raise SpecError(f"{where}: peak_tflops: give the dense peak TFLOP/s of at least one "
                        f"dtype ({', '.join(DTYPES)}), or a base GPU")
    bw = d.get("bandwidth_gbs", base.bandwidth_gbs if base else None)
    if bw is None:
        raise SpecError(f"{where}: bandwidth_gbs: the memory bandwidth (GB/s) is required")
    bw = _positive(bw, f"{where}: bandwidth_gbs")
    if bw > 1e5:
        raise SpecError(f"{where}: bandwidth_gbs: {bw:g} GB/s is implausible (wrong unit?)")
    if max(peaks.values()) > 1e5:
        raise SpecError(f"{where}: peak_tflops: {max(peaks.values()):g} TFLOP/s is "
                        "implausible (wrong unit? TFLOP/s, not FLOP/s)")

    def opt(field_: str, integer: bool = False) -> Any:
        v = d.get(field_, getattr(base, field_, None) if base else None)
        if v is None:
            return None
        x = _positive(v, f"{where}: {field_}")
        if integer:
            if x != int(x):
                raise SpecError(f"{where}: {field_}: {v!r} is not an integer")
            return int(x)
        return x

    cc = d.get("compute_capability", base.cc if base else None)
    if cc is not None and not isinstance(cc, tuple):
        m = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", str(cc))
        if not m:
            raise SpecError(f"{where}: compute_capability: {cc!r} is not like 8.0")
        cc = (int(m[1]), int(m[2]))
    aliases = d.get("aliases") or ()
    if isinstance(aliases, str) or not all(isinstance(a, str) for a in aliases):
        raise SpecError(f"{where}: aliases: expected a list of names")
    key = str(d.get("key") or compact(name) or "custom")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", key):
        raise SpecError(f"{where}: key: {key!r} must be 1-64 letters, digits, '.', '_', '-'")
    return GpuSpec(key=key, name=name.strip(), peak_tflops=peaks, bandwidth_gbs=bw,
                   power_w=opt("power_w"), memory_gb=opt("memory_gb"),
                   sm_count=opt("sm_count", integer=True), boost_mhz=opt("boost_mhz"),
                   cc=cc, vendor=str(d.get("vendor", base.vendor if base else "nvidia")),
                   form=str(d.get("form", "")),
                   source=str(d.get("source", f"user spec ({where})")),
                   aliases=tuple(aliases))


def _positive(v: Any, where: str, allow_none: bool = False) -> Any:
    if v is None and allow_none:
        return None
    if isinstance(v, str):  # YAML 1.1 reads 1.5e13 (no dot before the e) as text
        try:
            v = float(v)
        except ValueError:
            pass
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v != v \
            or v == float("inf"):
        raise SpecError(f"{where}: {v!r} is not a positive number")
    return float(v)


def load_gpu_specs(path: str | Path, catalogue: Catalogue | None = None) -> list[GpuSpec]:
    """GPU descriptions from a YAML or JSON file: one mapping, a list of them, or
    ``{gpus: [...]}`` (see spec_from_mapping for the fields). SpecError on any problem."""
    path = Path(path)
    try:  # bounded: /dev/zero, a FIFO or a huge file is refused, not read forever
        source, text = read_file(path)
        if path.suffix.lower() == ".json":
            try:
                doc = json.loads(text)
            except (ValueError, RecursionError) as e:
                raise SpecError(f"{path}: not valid JSON: {str(e)[:200]}") from None
        else:
            doc = read_yaml(text, source)[0]
    except ConfigError as e:
        raise SpecError(f"{path}: {e.problems[0]}") from None
    if isinstance(doc, Mapping) and "gpus" in doc:
        if set(doc) != {"gpus"}:
            raise SpecError(f"{path}: next to 'gpus' there should be nothing else")
        doc = doc["gpus"]
    items: Sequence[Any] = [doc] if isinstance(doc, Mapping) else doc
    if not isinstance(items, list) or not items:
        raise SpecError(f"{path}: expected a GPU (a mapping), a list of them, or gpus: [...]")
    specs = [spec_from_mapping(x, f"{path}: gpus[{i}]" if len(items) > 1 else str(path),
                               catalogue) for i, x in enumerate(items)]
    keys = [s.key for s in specs]
    dup = sorted({k for k in keys if keys.count(k) > 1})
    if dup:
        raise SpecError(f"{path}: key {dup[0]!r} is given twice")
    return specs


__all__ = ["CATALOGUE", "Catalogue", "GpuSpec", "SpecError", "arch_rates", "bandwidth",
           "compact", "enrich_device_info", "gpu_model_key", "load_gpu_specs", "lookup",
           "parse_name", "peak_flops", "spec_from_mapping"]
