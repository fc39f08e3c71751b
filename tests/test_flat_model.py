"""Model files as flat arrays (issue 26): the daemon predicts without scikit-learn, exactly
as the fitted forests do; a forged or damaged flat file is refused, naming it."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest
from test_model import _rows  # the same probe rows test_model fits on

from gemmd import features
from gemmd.config import FakeDeviceConfig, ModelConfig
from gemmd.devices.fake import FakeDevice
from gemmd.errors import ModelError
from gemmd.features import Table
from gemmd.files import file_sha256
from gemmd.gemm import ProbeSpec
from gemmd.model import ForestModel
from gemmd.model.flat import ARRAYS, _FlatForest
from gemmd.model.persistence import FLAT_HEAD, write_flat
from gemmd.registry import ModelRegistry
from gemmd.store import Store


@pytest.fixture(scope="module")
def dev():
    return FakeDevice(0, FakeDeviceConfig())


@pytest.fixture(scope="module")
def fitted(dev, tmp_path_factory):
    rows = _rows(dev, 240)
    model = ForestModel.fit(rows, [dev.info] * len(rows), ModelConfig(n_estimators=30))
    path = tmp_path_factory.mktemp("flat") / "m.skops"
    sha = model.save(path)
    return model, path, sha


def test_the_file_predicts_exactly_what_the_fitted_forests_predict(dev, fitted, monkeypatch):
    """Points, intervals and sds, one row or many (scikit-learn's predict above 64 rows,
    its flat copy below), equal to the last bit from the loaded flat arrays."""
    model, path, sha = fitted
    loaded = ForestModel.load(path, sha)
    assert set(loaded.forests) == set(model.forests) == {"runtime", "power"}
    assert all(isinstance(f, _FlatForest) for f in loaded.forests.values())
    test = _rows(dev, 300, seed=5)
    for n in (1, 7, 64, 65, 300):
        t = Table.from_rows(test[:n], [dev.info] * n)
        want, got = model.predict_table(t), loaded.predict_table(t)
        assert set(want) == set(got) == {"runtime", "power", "energy"}
        for target in want:
            for k in ("point", "lo", "hi", "sigma", "in_domain"):
                assert np.array_equal(want[target][k], got[target][k]), (n, target, k)
    # Each tree, on rows with missing features too (scikit-learn's missing_go_to_left).
    X = features.table_matrix(Table.from_rows(test, [dev.info] * len(test))).astype(np.float32)
    X[::5, 2] = np.nan
    X[::7, 30] = np.nan
    for target, rf in model.forests.items():
        want = np.stack([e.tree_.predict(X)[:, 0] for e in rf.estimators_])
        assert np.array_equal(loaded.forests[target].per_tree(X.astype(np.float64)), want)
    # Saved again from the flat arrays, a day later: the same file (no timestamps in it;
    # a save a second apart gave another sha256 on a slow machine).
    later = time.time() + 86400
    monkeypatch.setattr(time, "time", lambda: later)
    again = path.parent / "again.skops"
    assert loaded.save(again) == sha


_DAEMON_SIDE = """
import json, sys
from pathlib import Path
from gemmd.config import ModelConfig
from gemmd.gemm import ProbeSpec
from gemmd.registry import ModelRegistry, device_infos
from gemmd.store import Store
state = Path(sys.argv[1])
store = Store(state / "gemmd.db")
reg = ModelRegistry(store, state / "models", ModelConfig())
reg.load_active()
info = next(iter(device_infos(store).values()))
preds, version = reg.predict([ProbeSpec(2048, 1024, 4096, "bf16")], [info])
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"sklearn", "skops", "scipy", "joblib"})
print(json.dumps({"version": version, "runtime": preds[0].runtime_s,
                  "lo": preds[0].runtime_lo, "power": preds[0].power_w, "heavy": heavy}))
"""


def test_the_daemon_loads_and_predicts_without_scikit_learn(tmp_path, dev, fitted):
    """The daemon's side of a model (the registry loading the active one, a prediction),
    in a fresh interpreter: neither scikit-learn nor skops (nor SciPy) is imported."""
    model, _, _ = fitted
    store = Store(tmp_path / "gemmd.db")
    try:
        store.upsert_device(dev.info.uuid, 0, dev.info.name, "fake",
                            dataclasses.asdict(dev.info))
        version = ModelRegistry(store, tmp_path / "models", ModelConfig()).register(model)
    finally:
        store.close()
    p = subprocess.run([sys.executable, "-c", _DAEMON_SIDE, str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["heavy"] == [] and out["version"] == f"rf-{version}"
    (want,) = model.predict([ProbeSpec(2048, 1024, 4096, "bf16")], [dev.info])
    assert (out["runtime"], out["lo"], out["power"]) == \
        (want.runtime_s, want.runtime_lo, want.power_w)


def test_a_model_file_written_by_skops_still_loads(tmp_path, dev, fitted):
    """Files of the same model format written before the flat arrays (skops) are read
    (with scikit-learn) and predict as they did."""
    import skops.io as sio

    model, _, _ = fitted
    path = tmp_path / "old.skops"
    sio.dump({"forests": model.forests, "sigma": model.sigma, "z": model.z,
              "meta": json.dumps(model.meta)}, path)
    old = ForestModel.load(path, file_sha256(path))
    assert type(old.forests["runtime"]).__name__ == "RandomForestRegressor"
    spec = [ProbeSpec(1536, 3072, 768, "fp32")]
    assert old.predict(spec, [dev.info]) == model.predict(spec, [dev.info])


def _members(path):
    with zipfile.ZipFile(path) as z:
        return {n: z.read(n) for n in z.namelist()}


def _rewrite(path, members, compress=zipfile.ZIP_STORED):
    with zipfile.ZipFile(path, "w", compress) as z:
        for name, data in members.items():
            z.writestr(name, data)


def _npy(arr):
    import io

    buf = io.BytesIO()
    np.lib.format.write_array(buf, arr, allow_pickle=False)
    return buf.getvalue()


def test_a_forged_or_damaged_flat_file_is_refused_naming_it(tmp_path, fitted):
    model, path, _ = fitted
    good = _members(path)
    head = json.loads(good[FLAT_HEAD])
    bad = tmp_path / "bad.skops"

    def refused(members, match):
        _rewrite(bad, members)
        with pytest.raises(ModelError, match=match) as e:
            ForestModel.load(bad)
        assert str(bad) in str(e.value) and "\n" not in str(e.value)

    loaded = ForestModel.load(path)
    feat = loaded.forests["runtime"].arrays()["feature"].copy()
    feat[feat.argmax()] = len(features.FEATURES)  # an index past gemmd's features
    refused({**good, "runtime/feature.npy": _npy(feat)}, "runtime forest does not read gemmd's")
    refused({**good, FLAT_HEAD: json.dumps({**head, "n_features": 5})},
            "runtime forest does not read gemmd's")
    refused({**good, FLAT_HEAD: json.dumps({**head, "sigma": {"runtime": "x"}})},
            "prediction intervals")
    refused({**good, FLAT_HEAD: json.dumps({**head, "meta": {**head["meta"], "format": 3}})},
            "another gemmd version")
    refused({**good, "extra.npy": _npy(np.zeros(3))}, "not a gemmd model")
    refused({k: v for k, v in good.items() if k != "power/value.npy"}, "not a gemmd model")
    refused({**good, FLAT_HEAD: b"{not json"}, "not a gemmd model")
    refused({**good, FLAT_HEAD: json.dumps({**head, "code": "os.system"})}, "not a gemmd model")
    # An array of objects (pickle), of another type or length: refused before numpy reads it.
    objs = np.array([None] * 3, dtype=object)
    import io

    buf = io.BytesIO()
    np.lib.format.write_array(buf, objs, allow_pickle=True)
    refused({**good, "runtime/roots.npy": buf.getvalue()}, "not a gemmd model")
    roots = loaded.forests["runtime"].roots
    refused({**good, "runtime/roots.npy": _npy(roots.astype(np.int64))}, "not a gemmd model")
    refused({**good, "runtime/roots.npy": _npy(roots[:-1])}, "not a gemmd model")
    big = {**good, "runtime/roots.npy": _npy(roots)[:-4]}  # header says more than is there
    refused(big, "not a gemmd model")
    # Trees that are not trees: a node shared by two parents (the walk would double at
    # each level), a child out of its tree.
    arrays = loaded.forests["runtime"].arrays()
    left = arrays["left"].copy()
    inner = np.flatnonzero(left != np.arange(len(left)))
    left[inner[0]] = arrays["right"][inner[0]]
    refused({**good, "runtime/left.npy": _npy(left)}, "not a gemmd model.*runtime forest")
    right = arrays["right"].copy()
    right[inner[0]] = len(right)
    refused({**good, "runtime/right.npy": _npy(right)}, "not a gemmd model.*runtime forest")
    # A member that inflates far beyond the file: refused before it is read.
    _rewrite(bad, {**good, "runtime/value.npy": b"\0" * (80 << 20)}, zipfile.ZIP_DEFLATED)
    with pytest.raises(ModelError, match="would inflate to"):
        ForestModel.load(bad)


@pytest.mark.parametrize("edit, match", [
    (lambda h: h.update(z=-1.6), "its z"),  # printed intervals upside down
    (lambda h: h.update(z=1e300), "its z"),  # an infinite top
    (lambda h: h.update(sigma={**h["sigma"], "runtime": 1e300}), "its sigma"),  # overflow
    (lambda h: h["meta"].update(interval=5), "its interval"),  # "500% interval"
    (lambda h: h["meta"].update(interval="x"), "its interval"),
    (lambda h: h["meta"].update(interval_scale={"runtime": float("nan")}), "interval_scale"),
    (lambda h: h["meta"].update(interval_scale="x"), "interval_scale"),
    (lambda h: h["meta"].update(ood_sd="x"), "ood_sd"),
    (lambda h: h["meta"].update(interval_noise_floor={"runtime": "x"}), "noise_floor"),
    (lambda h: h["meta"].update(domain_targets="x"), "domain_targets"),
    (lambda h: h["meta"].update(repeats="x"), "repeats"),
    (lambda h: h["meta"].update(roofline_efficiency=-1), "roofline_efficiency"),
    (lambda h: h["meta"]["devices"][0]["peak_flops"].update(fp16=-1.0), "devices\\[0\\]"),
    (lambda h: h["meta"]["devices"][0]["peak_flops"].update(fp16="x"), "devices\\[0\\]"),
    (lambda h: h["meta"]["devices"][0].pop("name"), "devices\\[0\\]"),
    (lambda h: h["meta"]["devices"][0].update(bogus=1), "devices\\[0\\]"),
    (lambda h: h["meta"].update(devices="x"), "its devices"),
    (lambda h: h["meta"].update(configs="x"), "its configs"),
    (lambda h: h["meta"].update(configs=[{"device": 1}]), "its configs"),
    (lambda h: h["meta"].update(shapes="!!!notbase64"), "its shapes"),
    (lambda h: h["meta"].update(reference_shapes=[[0, 0]]), "reference_shapes"),
    (lambda h: h["meta"]["domain_targets"].update(runtime={"gpus": "x"}), "do not predict"),
])
def test_a_model_file_whose_metadata_were_edited_is_refused_naming_it(tmp_path, fitted,
                                                                       edit, match):
    """What predictions read from the metadata, of the type and range gemmd writes
    (check_meta), and one prediction per device at load (_self_check): an edited field
    gave tracebacks, upside-down or infinite intervals, a prediction from a NaN feature
    (a fuzz of the CLI, the nineteenth session). Refused with one line naming the file,
    in the daemon's registry as on the command line."""
    _, path, _ = fitted
    good = _members(path)
    head = json.loads(good[FLAT_HEAD])
    edit(head)
    bad = tmp_path / "edited.skops"
    _rewrite(bad, {**good, FLAT_HEAD: json.dumps(head)})
    with pytest.raises(ModelError, match=match) as e:
        ForestModel.load(bad)
    assert str(bad) in str(e.value) and "\n" not in str(e.value)
    ForestModel.load(path)  # (the file as written loads)


def test_a_model_whose_device_has_unknown_figures_still_loads(tmp_path, fitted):
    """A peak of 0 and no bandwidth are how a device record says 'not known' (a GPU whose
    clock NVML did not give): the daemon's own refit of such a device must load."""
    _, path, _ = fitted
    good = _members(path)
    head = json.loads(good[FLAT_HEAD])
    dev = head["meta"]["devices"][0]
    dev["peak_flops"] = dict.fromkeys(dev["peak_flops"], 0.0)
    dev["mem_bandwidth"] = 0.0
    unknown = tmp_path / "unknown.skops"
    _rewrite(unknown, {**good, FLAT_HEAD: json.dumps(head)})
    assert ForestModel.load(unknown).device_infos()[0].peak_flops["bf16"] == 0.0


def test_write_flat_round_trips_every_array(tmp_path, fitted):
    model, path, _ = fitted
    loaded = ForestModel.load(path)
    out = tmp_path / "copy.skops"
    write_flat(out, loaded.forests, loaded.sigma, loaded.z, loaded.meta)
    again = ForestModel.load(out)
    for target, flat in loaded.forests.items():
        for k in ARRAYS:
            a, b = flat.arrays()[k], again.forests[target].arrays()[k]
            assert a.dtype == b.dtype and np.array_equal(a, b)
        assert again.forests[target].depth == flat.depth == max(
            e.tree_.max_depth for e in model.forests[target].estimators_)


def test_tree_sizes_are_scikit_learns(fitted):
    model, path, _ = fitted
    loaded = ForestModel.load(path)
    for target, rf in model.forests.items():
        assert loaded.forests[target].tree_sizes() == [
            (e.tree_.node_count, e.tree_.n_leaves) for e in rf.estimators_]
