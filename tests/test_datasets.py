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


def test_gpperf_cutlass_power_read_on_an_idle_gpu_is_not_the_gemms(tmp_path):
    """One nvidia-smi sample per run: where the same sample reads the GPU idle (gpu_util
    below BUSY_UTIL), its power is an idle card's (GPPerf's file: 1,159 readings at 0%,
    30 W and 28 C; 10% of its runs under 15 ms read busy), not the GEMM's; dropped, and said.
    A reading without a utilization is kept; a utilization above 100% is refused."""
    head = CUTLASS_HEAD + ",gpu_util"
    rows = [f"1731372844,512,1024,2048,k,nt,64,128,32,2,lc,1,0,0.5,{p},2760,"
            f"NVIDIA GeForce RTX 4070,{u}"
            for p, u in (("30.1", "0"), ("33.0", "40"), ("153.0", "100"), ("150.0", "[N/A]"),
                         ("[N/A]", "100"))]
    ds = datasets.load("auto", [write(tmp_path / "c.csv", "\n".join([head, *rows]))])
    t = ds.table
    assert np.isnan(t["power_w"][:2]).all() and np.isnan(t["energy_j"][:2]).all()
    assert t["power_w"][2:4].tolist() == [153.0, 150.0]
    assert t["energy_j"][2] == pytest.approx(153.0 * 5e-4)
    assert np.isnan(t["power_w"][4]) and len(t) == 5
    assert any("power on 2 of 5 rows" in n and "2 more readings dropped" in n and
               "gpu_util below 90%" in n for n in ds.notes)
    bad = rows[2].rsplit(",", 1)[0] + ",150"
    with pytest.raises(InputError, match=r"row 2, column gpu_util: 150 % is above 100"):
        datasets.load("auto", [write(tmp_path / "d.csv", "\n".join([head, bad]))])


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
    # of its 2,595 power readings, 1,440 were sampled with the GPU idle for some or all
    # of the sample (gpu_util below 90%)
    assert len(c) == 16128 and int(np.isfinite(c["power_w"]).sum()) == 1155
    assert 1e-5 < np.nanmin(c["runtime_s"]) and np.nanmax(c["runtime_s"]) < 1.0
    x = datasets.load_shared("xla", DATA).table
    assert len(x) == 9750 and set(x["batch"]) == {1, 2, 4}


# ------------------------------------------------------------------ real-world CSVs (issue 14)


@pytest.mark.parametrize("header, factor", [
    ("runtime_ns", 1e-9), ("latency_ms", 1e-3), ("Time (us)", 1e-6), ("duration_s", 1.0),
    ("elapsed [ms]", 1e-3), ("median_time_us", 1e-6), ("Runtime-NS", 1e-9),
    ("kernel_time_usec", 1e-6),
])
def test_time_columns_in_any_unit(tmp_path, header, factor):
    value = 25000 if factor < 1 else 0.025  # 25000 s: over an hour, refused (issue 24)
    f = write(tmp_path / "t.csv", f"gpu,m,n,k,dtype,{header}\nNVIDIA L4,512,512,512,fp16,{value}\n")
    t = datasets.load("csv", [f]).table
    assert t["runtime_s"][0] == pytest.approx(value * factor)
    assert t.info(0).uuid == "ref-l4"


def test_extra_columns_are_ignored_with_a_note(tmp_path):
    f = write(tmp_path / "t.csv", """
GPU Name,M,N,K,precision,latency_ms,mean_time_ms,notes,host
NVIDIA A100-SXM4-80GB,1024,1024,1024,torch.bfloat16,0.02,0.021,ok,node1
""")
    ds = datasets.load("csv", [f])
    assert ds.table["runtime_s"][0] == pytest.approx(2e-5)  # latency, not the mean
    assert ds.table["dtype"][0] == "bf16" and ds.table.info(0).uuid == "ref-a100-sxm-80gb"
    assert "runtime from column latency_ms; mean_time_ms not used" in ds.notes
    assert "ignored columns notes, host (not used by gemmd's model)" in ds.notes


def test_gpu_flag_only_where_the_file_has_no_gpu_column(tmp_path):
    f = write(tmp_path / "t.csv", "gpu,m,n,k,dtype,runtime_us\nNVIDIA L4,64,64,64,fp16,5\n")
    with pytest.raises(InputError, match=r"row 2, column gpu: 'NVIDIA L4' is not --gpu "
                                         r"'h100-sxm'.*drop --gpu"):
        datasets.load("csv", [f], gpu="h100-sxm")
    assert datasets.load("csv", [f], gpu="l4").table.info(0).uuid == "ref-l4"  # agrees
    x = write(tmp_path / "x.csv", "gpu_key,b,m,n,k,dtype,runtime_us_derived\n"
                                  "sm_90,1,256,256,256,bf16xbf16->bf16,5\n")
    with pytest.raises(InputError, match="is not --gpu 'b200'"):
        datasets.load("xla", [x], gpu="b200")
    c = write(tmp_path / "c.csv", f"{CUTLASS_HEAD}\n1,512,512,512,k,nn,64,64,8,2,lc,1,0,0.5,"
                                  "70,2760,NVIDIA GeForce RTX 4070")
    with pytest.raises(InputError, match="is not --gpu 'l4'"):
        datasets.load("gpperf-cutlass", [c], gpu="l4")


def test_gpu_columns_describe_a_gpu_the_catalogue_lacks(tmp_path):
    f = write(tmp_path / "t.csv", """
gpu,m,n,k,dtype,runtime_us,peak_bf16_tflops,peak_fp32_tflops,mem_bandwidth_gbs,sm_count
Lab GPU X,1024,1024,1024,bf16,20,400,100,2000,120
Lab GPU X,2048,2048,2048,bf16,90,400,100,2000,120
NVIDIA L4,1024,1024,1024,bf16,30,,,,
""")
    t = datasets.load("csv", [f]).table
    lab = t.info(0)
    assert lab.name == "Lab GPU X" and lab.peak_flops["bf16"] == 400e12 and lab.sm_count == 120
    assert t.info(1) is lab and t.info(2).uuid == "ref-l4"
    # the catalogue's own figures (an export, say) give the catalogue's device
    same = write(tmp_path / "s.csv", "gpu,m,n,k,dtype,runtime_us,peak_fp16_tflops,"
                                     "mem_bandwidth_gbs\nNVIDIA L4,64,64,64,fp16,5,121,300\n")
    assert datasets.load("csv", [same]).table.info(0).uuid == "ref-l4"
    slow = write(tmp_path / "l.csv", "gpu,m,n,k,dtype,runtime_us,peak_fp16_tflops\n"
                                     "NVIDIA L4,64,64,64,fp16,5,60\n")
    info = datasets.load("csv", [slow]).table.info(0)
    assert info.peak_flops["fp16"] == 60e12 and info.uuid != "ref-l4"
    assert info.extra["key"] == "l4"  # still an L4 to the model's domain
    bad = write(tmp_path / "b.csv", "gpu,m,n,k,dtype,runtime_us,peak_fp32_tflops\n"
                                    "Lab GPU Y,64,64,64,fp32,5,10\n")
    with pytest.raises(InputError, match="bandwidth_gbs: the memory bandwidth"):
        datasets.load("csv", [bad])


def test_a_dtype_the_gpu_has_no_peak_for(tmp_path):
    f = write(tmp_path / "t.csv", "gpu,m,n,k,dtype,runtime_us\nTesla V100-SXM2-32GB,64,64,64,"
                                  "bf16,5\n")
    with pytest.raises(InputError, match="row 2, column dtype: Tesla V100-SXM2-32GB has no "
                                         "bf16 peak.*peak_bf16_tflops"):
        datasets.load("csv", [f])


def test_a_catalogue_with_user_gpus(tmp_path):
    from gemmd.hardware import CATALOGUE, spec_from_mapping

    cat = CATALOGUE.with_specs([spec_from_mapping(
        {"name": "Lab GPU Z", "peak_tflops": {"fp16": 50}, "bandwidth_gbs": 400}, "test")])
    f = write(tmp_path / "t.csv", "m,n,k,dtype,runtime_us\n64,64,64,fp16,5\n")
    assert datasets.load("csv", [f], gpu="Lab GPU Z", catalog=cat).table.info(0).name == \
        "Lab GPU Z"
    with pytest.raises(InputError, match="unknown GPU 'Lab GPU Z'.*--gpu-spec"):
        datasets.load("csv", [f], gpu="Lab GPU Z")
