"""Imports: a named source in the store, kept apart from the daemon's probes, all or nothing."""

from __future__ import annotations

import pytest

from gemmd import datasets, importer
from gemmd.errors import InputError
from gemmd.features import Table
from gemmd.registry import training_data
from gemmd.store import SCHEMA_VERSION
from gemmd.store.schema import PROBE_COLUMNS

CUTLASS = """\
timestamp,M,N,K,kernel,layout,cta_m,cta_n,cta_k,stages,epilogue,alpha,beta,runtime_ms,power_W
1731372844,512,1024,2048,k,nt,64,128,32,2,lc,1,0,0.5,70.0
1731372849,1024,1024,2048,k,nn,128,128,32,2,lc,0.5,0.5,0.9,[N/A]
"""


def test_schema_has_the_import_columns(store):
    assert SCHEMA_VERSION >= 2
    cols = set(store.columns("probes"))
    assert set(PROBE_COLUMNS) <= cols
    assert {"batch", "cta_m", "cta_n", "cta_k", "stages", "alpha", "beta", "out_dtype"} <= cols


def test_import_is_a_named_source_kept_apart(tmp_path, store):
    f = tmp_path / "c.csv"
    f.write_text(CUTLASS)
    ds = datasets.load("auto", [f])
    assert importer.import_dataset(store, ds, "gpperf") == 2
    rows = store.probes(sources=["gpperf"])
    assert len(rows) == 2 and {r["kind"] for r in rows} == {"import"}
    assert {r["device_uuid"] for r in rows} == {"ref-rtx4070"}
    # The daemon's refits read source "daemon" only.
    assert training_data(store) == ([], [])
    rows, infos = training_data(store, ["gpperf"])
    assert infos[0].sm_count == 46
    t = Table.from_rows(rows, infos)
    # Configuration a probe does not have survives the round trip through the store.
    back = {(int(t["m"][i]), int(t["cta_m"][i]), int(t["cta_n"][i]), t["alpha"][i],
             t["beta"][i], t["layout"][i], t["kernel"][i]) for i in range(len(t))}
    assert back == {(512, 64, 128, 1.0, 0.0, "nt", "cutlass"),
                    (1024, 128, 128, 0.5, 0.5, "nn", "cutlass")}
    assert sorted(r["runtime_s"] for r in rows) == pytest.approx([5e-4, 9e-4])
    assert min(r["ts"] for r in rows) == 1731372844  # the file's own timestamps


def test_reimport_and_reserved_names_are_refused(tmp_path, store):
    f = tmp_path / "c.csv"
    f.write_text(CUTLASS)
    ds = datasets.load("auto", [f])
    importer.import_dataset(store, ds, "x")
    with pytest.raises(InputError, match="source 'x' already holds 2 rows"):
        importer.import_dataset(store, ds, "x")
    with pytest.raises(InputError, match="reserved for the daemon"):
        importer.import_dataset(store, ds, "daemon")
    with pytest.raises(InputError, match="must be 1-64 letters"):
        importer.import_dataset(store, ds, "a b")
    assert sum(c["n"] for c in store.counts()) == 2


def test_a_bad_file_imports_nothing(tmp_path, store):
    good = tmp_path / "good.csv"
    good.write_text("gpu,m,n,k,dtype,runtime_ms\nrtx4070,8,8,8,fp32,1\n")
    importer.import_dataset(store, datasets.load("csv", [good]), "first")
    before = sum(c["n"] for c in store.counts())
    bad = tmp_path / "bad.csv"
    lines = ["gpu,m,n,k,dtype,runtime_ms"] + [f"rtx4070,{8 * i},8,8,fp32,1" for i in
                                             range(1, 50)]
    lines[40] = "rtx4070,64,8,8,fp32,12;5"
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError, match=r"bad.csv: row 41, column runtime_ms: '12;5' is not"):
        ds = datasets.load("csv", [bad])
        importer.import_dataset(store, ds, "second")
    assert sum(c["n"] for c in store.counts()) == before
