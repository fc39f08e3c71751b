"""The GPU catalogue: datasheet figures, names as NVML prints them, user-described GPUs,
and enriching what NVML says."""

from __future__ import annotations

import json

import pytest

from gemmd import hardware
from gemmd.hardware import CATALOGUE, SpecError, enrich_device_info, gpu_model_key
from gemmd.records import DeviceInfo


@pytest.mark.parametrize("name, key", [
    ("NVIDIA A100-SXM4-80GB", "a100-sxm-80gb"),
    ("NVIDIA A100-SXM4-40GB", "a100-sxm-40gb"),
    ("NVIDIA A100 80GB PCIe", "a100-pcie-80gb"),
    ("NVIDIA A100-PCIE-40GB", "a100-pcie-40gb"),
    ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", "a100-sxm-40gb"),
    ("Tesla V100-PCIE-32GB", "v100-pcie-32gb"),
    ("Tesla V100-SXM2-16GB", "v100-sxm2-16gb"),
    ("Tesla V100S-PCIE-32GB", "v100s-pcie"),
    ("Tesla T4", "t4"),
    ("NVIDIA A2", "a2"), ("NVIDIA A10", "a10"), ("NVIDIA A16", "a16"), ("NVIDIA A30", "a30"),
    ("NVIDIA A40", "a40"), ("NVIDIA L4", "l4"), ("NVIDIA L40", "l40"), ("NVIDIA L40S", "l40s"),
    ("NVIDIA H100 80GB HBM3", "h100-sxm"),
    ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA H100 NVL", "h100-nvl"),
    ("NVIDIA H20", "h20"), ("NVIDIA H200", "h200"), ("NVIDIA H200 NVL", "h200-nvl"),
    ("NVIDIA B200", "b200"), ("NVIDIA B300 SXM6 AC", "b300"), ("NVIDIA GB200", "gb200"),
    ("NVIDIA GeForce RTX 4090", "rtx4090"),
    ("NVIDIA GeForce RTX 4070", "rtx4070"),
    ("NVIDIA RTX 6000 Ada Generation", "rtx6000-ada"),
    ("AMD Instinct MI355X", "mi355x"),
    # the keys and aliases gemmd always took
    ("rtx4070", "rtx4070"), ("b200", "b200"), ("h100-sxm", "h100-sxm"), ("mi355x", "mi355x"),
    ("B200-SXM-192GB", "b200"), ("sm_90", "h100-sxm"), ("sm_100_B200", "b200"),
    ("gfx950", "mi355x"), ("h100", "h100-sxm"), ("A100", "a100-sxm-80gb"),
    # a bare size after the model number, as file names and spreadsheets write it
    ("a100_40", "a100-sxm-40gb"), ("a100-pcie-80", "a100-pcie-80gb"),
    ("v100 pcie 16", "v100-pcie-16gb"), ("rtx 4070 12", "rtx4070"),
])
def test_names_as_tools_print_them(name, key):
    spec = hardware.lookup(name)
    assert spec is not None and spec.key == key


@pytest.mark.parametrize("name", ["NVIDIA GeForce RTX 4070 SUPER", "Quadro RTX 6000",
                                  "NVIDIA A10G", "rtx9999", "", "HBM3"])
def test_other_gpus_are_not_guessed(name):
    assert hardware.lookup(name) is None


def test_every_entry_is_sourced_and_sane():
    for spec in CATALOGUE.specs.values():
        p = spec.peak_tflops
        assert spec.source, spec.key
        assert spec.bandwidth_gbs > 100 and p["fp32"] > 1, spec.key
        for low in ("fp32", "tf32"):  # dense tensor rates: fp16 >= tf32 >= ... fp32
            if "fp16" in p and low in p:
                assert p["fp16"] >= p[low], spec.key
        if "fp8" in p:
            assert p["fp8"] >= p["fp16"], spec.key
        assert spec.info().uuid == f"ref-{spec.key}"
    # dense, not "with sparsity": the H100 SXM datasheet's 1979 TFLOPS bf16 is sparse
    assert CATALOGUE.specs["h100-sxm"].peak_tflops["bf16"] == pytest.approx(989.5)
    assert CATALOGUE.specs["a100-sxm-80gb"].peak_tflops["tf32"] == 156
    assert "bf16" not in CATALOGUE.specs["v100-sxm2-32gb"].peak_tflops
    assert CATALOGUE.info("rtx4070") is CATALOGUE.info("NVIDIA GeForce RTX 4070")


def _nvml(name: str, **kw) -> DeviceInfo:
    base = {"index": 0, "uuid": "GPU-1234", "name": name, "backend": "nvidia",
            "peak_flops": {"fp32": 1e12, "bf16": 9e12}, "mem_bandwidth": 1.9e12,
            "sm_count": 108, "power_limit_w": 350.0, "extra": {"pci_bus_id": "0:1"}}
    return DeviceInfo(**{**base, **kw})


def test_enrich_device_info_from_the_catalogue():
    info = enrich_device_info(_nvml("NVIDIA A100-SXM4-80GB"))
    assert info.peak_flops["bf16"] == 312e12 and info.peak_flops["tf32"] == 156e12
    assert info.mem_bandwidth == 2039e9
    assert info.power_limit_w == 350.0  # what NVML says the card is limited to
    assert info.extra["catalogue"] == "a100-sxm-80gb" and info.extra["pci_bus_id"] == "0:1"
    assert info.extra["peak_flops_clock"]["bf16"] == 9e12
    assert enrich_device_info(info) is info  # once is enough
    assert gpu_model_key(info) == "a100-sxm-80gb"
    filled = enrich_device_info(_nvml("NVIDIA L4", power_limit_w=None, sm_count=None))
    assert filled.power_limit_w == 72 and filled.sm_count == 58
    fake = _nvml("NVIDIA H100 80GB HBM3 (fake)", backend="fake")
    assert enrich_device_info(fake) is fake
    cpu = _nvml("AMD EPYC 7B13", backend="cpu")
    assert enrich_device_info(cpu) is cpu


def test_gpu_spec_files(tmp_path):
    y = tmp_path / "gpus.yaml"
    y.write_text("""
gpus:
  - name: NVIDIA RTX PRO 6000 Blackwell
    key: rtxpro6000
    peak_tflops: {fp32: 126, bf16: 503}
    bandwidth_gbs: 1792
    sm_count: 188
    power_w: 600
  - name: A100 capped at 1.1 GHz
    base: a100-sxm-80gb
    peak_tflops: {bf16: 243}
""")
    specs = hardware.load_gpu_specs(y)
    assert [s.key for s in specs] == ["rtxpro6000", "a100cappedat11ghz"]
    assert specs[1].bandwidth_gbs == 2039 and specs[1].peak_tflops["bf16"] == 243
    assert specs[1].peak_tflops["tf32"] == 156  # from its base
    cat = CATALOGUE.with_specs(specs)
    assert cat.info("NVIDIA RTX PRO 6000 Blackwell").sm_count == 188
    assert cat.info("rtxpro6000").peak_flops["bf16"] == 503e12
    assert CATALOGUE.lookup("rtxpro6000") is None  # the shared catalogue is unchanged
    j = tmp_path / "one.json"
    j.write_text(json.dumps({"name": "Lab GPU", "peak_tflops": {"fp32": 10},
                             "bandwidth_gbs": 500}))
    assert hardware.load_gpu_specs(j)[0].key == "labgpu"


@pytest.mark.parametrize("text, gist", [
    ("name: X\npeak_tflops: {fp32: 10}", "bandwidth_gbs: the memory bandwidth"),
    ("name: X\nbandwidth_gbs: 10", "peak_tflops: give the dense peak"),
    ("name: X\npeak_tflops: {fp31: 1}\nbandwidth_gbs: 10", "peak_tflops.fp31: not a dtype"),
    ("name: X\npeak_tflops: {fp32: 1.5e13}\nbandwidth_gbs: 10", "implausible (wrong unit?"),
    ("name: X\npeak_tflops: {fp32: 1}\nbandwidth_gbs: -3", "-3 is not a positive number"),
    ("name: X\nbase: nope", "base: unknown GPU 'nope'"),
    ("name: X\ncolour: red\nbase: l4", "unknown field colour"),
    ("- 1\n- 2", "expected a mapping of fields"),
    ("peak_tflops: [", "line 2, column 1: invalid YAML"),
])
def test_gpu_spec_errors_name_the_field(tmp_path, text, gist):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(SpecError) as e:
        hardware.load_gpu_specs(f)
    assert gist in str(e.value) and str(f) in str(e.value)


@pytest.mark.parametrize("make, gist", [
    (lambda d: "/dev/zero", "larger than 1024 KiB"),  # was read until the OOM killer came
    (lambda d: str(d), "cannot read: Is a directory"),
    (lambda d: _write(d / "bomb.yaml", "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [{', '.join(['*' + p] * 10)}]\n" for p, c in zip("abcdefgh", "bcdefghi"))),
     "aliases expand the document beyond"),
    (lambda d: _write(d / "dup.yaml", "name: X\nbandwidth_gbs: 1\nname: Y\n"), "duplicate key"),
    (lambda d: _write(d / "deep.json", "[" * 100000 + "]" * 100000), "not valid JSON"),
])
def test_gpu_spec_files_are_read_as_carefully_as_the_config(tmp_path, make, gist):
    path = make(tmp_path)
    with pytest.raises(SpecError) as e:
        hardware.load_gpu_specs(path)
    assert gist in str(e.value) and str(path) in str(e.value)


def _write(path, text):
    path.write_text(text)
    return path


# ------------------------------------------------------------------ physics bounds (issue 25)

# The first real GPU run (bench/results/2026-11-26-h200, 8192^3 and 4096^3, cuBLAS through
# gemmd's probes, torch and CuPy): the most any dtype reached, TFLOP/s, at the 700 W cap.
H200_MEASURED_TFLOPS = {"fp64": 55.0, "fp32": 51.4, "tf32": 360.0, "fp16": 682.0,
                        "bf16": 693.0}


def test_the_h200_of_bench_results_never_beats_its_catalogued_peaks():
    """The catalogue's peaks bound what the model may predict: they must bound what the
    hardware did (a bound below a real measurement would make every such prediction
    wrong)."""
    spec = CATALOGUE.lookup("NVIDIA H200")
    assert spec is not None and spec.key == "h200" and spec.power_w == 700
    for dtype, tflops in H200_MEASURED_TFLOPS.items():
        assert tflops < spec.peak_tflops[dtype], dtype
        assert tflops / spec.peak_tflops[dtype] > 0.5, dtype  # and not far below them


def test_bounds_clip_points_and_intervals_and_leave_the_cpu_alone():
    import numpy as np

    from gemmd import bounds, datasets
    from gemmd.features import Table, roofline

    h100 = datasets.KNOWN_GPUS["h100-sxm"]
    cpu = DeviceInfo(index=0, uuid="CPU-x", name="a CPU", backend="cpu",
                     peak_flops={"fp32": 1e12}, mem_bandwidth=1e10, power_limit_w=100.0)
    t = Table.from_rows([{"m": 4096, "n": 4096, "k": 4096, "dtype": "bf16"}] * 2,
                        [h100, cpu])
    floor = bounds.runtime_floor(t)
    assert floor[0] == pytest.approx(roofline(t)[0]) and floor[1] == 0.0
    out = {"runtime": {"point": np.array([1e-6, 1e-6]), "lo": np.array([1e-7, 1e-7]),
                       "hi": np.array([2e-6, 2e-6])},
           "power": {"point": np.array([900.0, 900.0]), "lo": np.array([1.0, 1.0]),
                     "hi": np.array([1e4, 1e4])},
           "energy": {"point": np.array([5.0, 5.0]), "lo": np.array([0.0, 0.0]),
                      "hi": np.array([6.0, 6.0])}}
    bounds.clip(out, t)
    rt, pw, en = out["runtime"], out["power"], out["energy"]
    assert rt["point"][0] == rt["lo"][0] == rt["hi"][0] == pytest.approx(floor[0])
    assert pw["point"][0] == 700 and pw["lo"][0] == pytest.approx(28.0)
    assert pw["hi"][0] == pytest.approx(700 * (1 + bounds.LIMIT_TOLERANCE))
    assert en["point"][0] == pytest.approx(700 * rt["point"][0])  # at most limit x runtime
    assert en["lo"][0] <= en["point"][0] <= en["hi"][0]
    assert en["lo"][0] >= 28.0 * floor[0] * (1 - 1e-9)
    # the CPU backend's figures are estimates, not bounds: left as predicted
    assert rt["point"][1] == 1e-6 and pw["point"][1] == 900.0
    # measurements that break the bounds are named (bad data, or L2-resident operands)
    t.cols["runtime_s"] = np.array([floor[0] / 2, 1.0])
    t.cols["power_w"] = np.array([822.0, 5.0])  # an H100's 0.5 s window after idle read
    assert not bounds.violations(t)["power"][0]  # 1.174x its 700 W limit: not bad data
    t.cols["power_w"] = np.array([900.0, 5.0])  # 1.29x
    v = bounds.violations(t)
    assert v["runtime"].tolist() == [True, False] and v["power"].tolist() == [True, False]
