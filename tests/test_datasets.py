"""Loaders of external measurements: units to SI, GPU table, and one-line errors for bad files."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gemmd import datasets
from gemmd.errors import InputError

DATA = datasets.shared_data_dir()
needs_data = pytest.mark.skipif(DATA is None, reason="shared datasets (../shared/data) absent")


def write(path, text):
    path.write_text(text.strip() + "\n")
    return path


CUTLASS_HEAD = ("timestamp,M,N,K,kernel,layout,cta_m,cta_n,cta_k,stages,epilogue,alpha,beta,"
                "runtime_ms,power_W,sm_clock_MHz,gpu_name")


def test_known_gpus_and_aliases():
    assert datasets.known_gpu("NVIDIA GeForce RTX 4070").sm_count == 46
    assert datasets.known_gpu("B200-SXM-192GB") is datasets.KNOWN_GPUS["b200"]
    assert datasets.known_gpu("sm_90").sm_count == 132
    assert datasets.known_gpu("gfx950").name.startswith("AMD")
    assert datasets.known_gpu("nope") is None
    rtx = datasets.KNOWN_GPUS["rtx4070"]
    assert rtx.peak_flops["fp32"] == pytest.approx(29.1e12, rel=0.01)
    assert rtx.mem_bandwidth == 504e9


def test_gpperf_cutlass_units(tmp_path):
    f = write(tmp_path / "c.csv", f"""
{CUTLASS_HEAD}
1731372844,512,1024,2048,k,nt,64,128,32,2,lc,1,0,0.5,70.0,2760,NVIDIA GeForce RTX 4070
1731372849,512,1024,2048,k,nt,64,128,32,2,lc,1,1,0.25,[N/A],2760,NVIDIA GeForce RTX 4070
""")
    ds = datasets.load("auto", [f])
    t = ds.table
    assert ds.name == "gpperf-cutlass" and len(t) == 2
    assert t["runtime_s"].tolist() == [5e-4, 2.5e-4]
    assert t["power_w"][0] == 70.0 and math.isnan(t["power_w"][1])
    assert t["energy_j"][0] == pytest.approx(70.0 * 5e-4) and math.isnan(t["energy_j"][1])
    assert (t["m"][0], t["n"][0], t["k"][0]) == (512, 1024, 2048)
    assert (t["cta_m"][0], t["cta_n"][0], t["cta_k"][0]) == (64, 128, 32)
    assert t["layout"][0] == "nt" and t["kernel"][0] == "cutlass" and t["beta"][1] == 1
    assert t.info(0).name == "NVIDIA GeForce RTX 4070"
    assert ds.targets == ["runtime", "power", "energy"]


def test_b200_column_order_and_units(tmp_path):
    f = write(tmp_path / "b.csv", """
gpu,dtype,m,k,n,time(us),mem_clk_freq,graph_clk_freq,avg_power(W),avg_energy(uJ)
B200-SXM-192GB,half,16,32,64,10,3996,1965,200.0,2000.0
B200-SXM-192GB,fp8,8,16,32,8,3996,1965,250.0,2000.0
""")
    t = datasets.load("b200", [f]).table
    assert (t["m"][0], t["n"][0], t["k"][0]) == (16, 64, 32)  # file order is m,k,n
    assert t["dtype"].tolist() == ["fp16", "fp8"]
    assert t["runtime_s"][0] == pytest.approx(10e-6)
    assert t["energy_j"][0] == pytest.approx(2000e-6)
    assert t.info(0).sm_count == 148


def test_xla_dtypes_batch_and_gpus(tmp_path):
    f = write(tmp_path / "x.csv", """
gpu_key,b,m,n,k,dtype,flops_per_s,runtime_us_derived
sm_90,2,256,512,1024,bf16xbf16->bf16,1e14,5.0
gfx950,1,256,256,256,f8e4m3fnxf8e5m2->f32,1e14,4.0
sm_100_B200,4,256,256,256,f32xf32->f32,1e14,3.0
""")
    t = datasets.load("auto", [f]).table
    assert t["batch"].tolist() == [2, 1, 4]
    assert t["dtype"].tolist() == ["bf16", "fp8", "tf32"]
    assert t["out_dtype"].tolist() == ["bf16", "fp32", "fp32"]
    assert [t.info(i).uuid for i in range(3)] == ["ref-h100-sxm", "ref-mi355x", "ref-b200"]
    assert t["runtime_s"][0] == pytest.approx(5e-6)


def test_gpperf_tiled_both_files(tmp_path):
    a = write(tmp_path / "e.csv", "M,N,K,Tile Size,Execution Time\n512,512,512,16,5.5")
    b = write(tmp_path / "p.csv", "M,N,K,Tile Size,Average Power Usage (W)\n512,512,512,8,33")
    ds = datasets.load("gpperf-tiled", [a, b])
    t = ds.table
    assert len(t) == 2 and t["kernel"].tolist() == ["tiled", "tiled"]
    assert t["tile"].tolist() == [16, 8]
    assert t["runtime_s"][0] == pytest.approx(5.5e-3) and math.isnan(t["runtime_s"][1])
    assert t["power_w"][1] == 33 and math.isnan(t["power_w"][0])


GOOD = """
gpu,m,n,k,dtype,kernel,tile,layout,runtime_ms,power_w,energy_mj
rtx4070,1024,1024,1024,fp32,blas,,nn,0.2,150,30
rtx4070,512,512,512,float32,tiled,16,,1.0,,
"""


def test_generic_csv(tmp_path):
    ds = datasets.load("csv", [write(tmp_path / "g.csv", GOOD)])
    t = ds.table
    assert t["runtime_s"].tolist() == pytest.approx([2e-4, 1e-3])
    assert t["energy_j"][0] == pytest.approx(0.03)
    assert t["dtype"].tolist() == ["fp32", "fp32"]
    assert t["kernel"].tolist() == ["blas", "tiled"] and t["tile"].tolist() == [0, 16]
    assert t["layout"].tolist() == ["nn", "nn"]
    # --gpu stands in for a missing gpu column.
    f = write(tmp_path / "h.csv", "m,n,k,dtype,runtime_us\n64,64,64,fp16,5")
    assert datasets.load("csv", [f], gpu="b200").table.info(0).uuid == "ref-b200"


@pytest.mark.parametrize("text, message", [
    ("m,n,k,dtype,runtime_ms\n1,2", "row 2: 2 fields, the header has 5"),
    ("m,n,dtype,runtime_ms\n1,2,fp32,1", "missing column k"),
    ("m,n,k,dtype,runtime\n8,8,8,fp32,1", "column runtime has no unit; name it runtime_s, "
                                          "runtime_ms or runtime_us"),
    ("m,n,k,dtype,power\n8,8,8,fp32,1", "column power has no unit"),
    ("m,n,k,dtype\n8,8,8,fp32", "no measurement column"),
    ("m,n,k,dtype,runtime_ms\n8,8,8,fp32,1\n8,8,8,fp32,abc", "row 3, column runtime_ms: "
                                                              "'abc' is not a number"),
    ("m,n,k,dtype,runtime_ms\n8,8,8,fp32,-1", "row 2, column runtime_ms: -1 ms is not positive"),
    ("m,n,k,dtype,runtime_ms\n8,8.5,8,fp32,1", "row 2, column n: '8.5' is not an integer"),
    ("m,n,k,dtype,runtime_ms\n8,8,8,fp33,1", "row 2, column dtype: 'fp33' is not a known dtype"),
    ("m,n,k,dtype,power_w\n8,8,8,fp32,150000", "row 2, column power_w: 150000 W is above "
                                              "5000 W (wrong unit?)"),
    ("m,n,k,dtype,runtime_s\n8192,8192,8192,fp32,0.000001", "row 2, column runtime_s: "
                                                            "1.1e+06 TFLOP/s is over 4x"),
    ("m,n,k,dtype,runtime_s,power_w,energy_j\n512,512,512,fp32,0.001,100,100",
     "row 2, column energy_j: energy is 1e+03x power x runtime"),
    ("m,n,k,dtype,runtime_ms,colour\n8,8,8,fp32,1,red", "unknown column colour"),
    ("m,n,k,dtype,runtime_ms,power_w\n8,8,8,fp32,,", "row 2, column runtime_ms, power_w: "
                                                    "no measurement on this row"),
    ("", "empty file"),
    ("m,n,k,dtype,runtime_ms", "no data rows"),
])
def test_generic_csv_errors_name_row_and_column(tmp_path, text, message):
    f = tmp_path / "bad.csv"
    f.write_text(text + "\n" if text else "")
    with pytest.raises(InputError) as e:
        datasets.load("csv", [f], gpu="rtx4070")
    assert message in str(e.value)
    assert str(e.value).startswith(str(f))
    assert "\n" not in str(e.value)


def test_unknown_gpu_and_missing_file(tmp_path):
    f = write(tmp_path / "g.csv", "gpu,m,n,k,dtype,runtime_ms\nrtx9999,8,8,8,fp32,1")
    with pytest.raises(InputError, match="row 2, column gpu: unknown GPU 'rtx9999'"):
        datasets.load("csv", [f])
    f = write(tmp_path / "h.csv", "m,n,k,dtype,runtime_ms\n8,8,8,fp32,1")
    with pytest.raises(InputError, match="missing column gpu .or give the GPU with --gpu"):
        datasets.load("csv", [f])
    with pytest.raises(InputError, match="cannot read"):
        datasets.load("csv", [tmp_path / "absent.csv"])


def test_detect_format(tmp_path):
    assert datasets.detect_format(write(tmp_path / "a.csv", CUTLASS_HEAD)) == "gpperf-cutlass"
    assert datasets.detect_format(write(tmp_path / "b.csv", "m,n,k,dtype,runtime_s")) == "csv"


@needs_data
def test_shared_datasets_load_in_si_units():
    c = datasets.load_shared("gpperf-cutlass", DATA).table
    assert len(c) == 16128 and int(np.isfinite(c["power_w"]).sum()) == 2595
    assert 1e-5 < np.nanmin(c["runtime_s"]) and np.nanmax(c["runtime_s"]) < 1.0
    x = datasets.load_shared("xla", DATA).table
    assert len(x) == 9750 and set(x["batch"]) == {1, 2, 4}
