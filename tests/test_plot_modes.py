"""plot_modes.py: the figure of a report, from harness.py, busbw.py or megatron_e2e.py JSON."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "bench" / "plot_modes.py"


def _module():
    spec = importlib.util.spec_from_file_location("plot_modes", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _plot(tmp_path, documents):
    paths = []
    for i, document in enumerate(documents):
        path = tmp_path / f"in{i}.json"
        path.write_text(json.dumps(document))
        paths.append(str(path))
    out = tmp_path / "figure.png"
    proc = subprocess.run([sys.executable, str(SCRIPT), *paths, "-o", str(out)],
                          capture_output=True, text=True, timeout=120)
    return proc, out


def _busbw(times):
    return {"schema": "commsched.bench.busbw/1",
            "settings": {"world_size": 2, "regime": "nvlink"},
            "variants": {name: {"rows": [{"size": 2048 << i, "time_us": t,
                                          "time_us_rounds": [t - 1, t, t + 2]}
                                         for i, t in enumerate(values)]}
                         for name, values in times.items()}}


def test_a_busbw_file_is_plotted_per_size_and_variant(tmp_path):
    proc, out = _plot(tmp_path, [_busbw({"nccl": [40.0, 41.0], "none": [50.0, 52.0]})])
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_busbw_points_keep_the_rounds_range():
    series = _module().busbw_series(_busbw({"none": [50.0]}))
    assert series == {"none": [(2048, 50.0, 49.0, 52.0)]}


def test_a_busbw_file_is_plotted_alone_and_an_empty_one_is_an_error(tmp_path):
    proc, _ = _plot(tmp_path, [_busbw({"nccl": [40.0]}), _busbw({"nccl": [40.0]})])
    assert proc.returncode == 2 and "one file" in proc.stderr
    proc, out = _plot(tmp_path, [_busbw({})])
    assert proc.returncode == 1 and not out.exists()


def test_a_harness_file_is_plotted_per_mode(tmp_path):
    mode = {"status": "ok", "label": "4 DDP default", "median_ms": 100.0, "p10_ms": 99.0,
            "p90_ms": 102.0}
    document = {"launches": [{"runs": [{"regime": "nvlink", "model": "gpt",
                                         "modes": {"ddp_default": mode,
                                                   "compute_only": {"status": "n/a"}}}]}]}
    proc, out = _plot(tmp_path, [document])
    assert proc.returncode == 0, proc.stderr
    assert out.stat().st_size > 1000


def test_the_floor_row_has_no_spread(tmp_path):
    """The floor is computed from two modes, with a median and no samples."""
    floor = {"status": "ok", "label": "3 floor = max(1, 2)", "median_ms": 80.0,
             "p10_ms": None, "p90_ms": None}
    ddp = {"status": "ok", "label": "4 DDP default", "median_ms": 90.0, "p10_ms": 88.0,
           "p90_ms": 95.0}
    document = {"launches": [{"runs": [{"regime": "host", "model": "gpt",
                                         "modes": {"floor": floor, "ddp_default": ddp}}]}]}
    path = tmp_path / "h.json"
    path.write_text(json.dumps(document))
    assert _module().panels([path]) == {("host", "gpt"): [
        ("3 floor = max(1, 2)", 80.0, 80.0, 80.0), ("4 DDP default", 90.0, 88.0, 95.0)]}


def test_a_megatron_file_gives_a_panel_per_setting_with_the_rounds_range(tmp_path):
    summary = {"nvlink/no_overlap": {"regime": "nvlink", "setting": "no_overlap",
                                     "stock_ms": [231.2, 216.8], "stock_median_ms": 224.0,
                                     "patched_ms": [233.0, 222.8],
                                     "patched_median_ms": 227.9}}
    with_launcher = {"k": dict(summary["nvlink/no_overlap"], setting="overlap_grad",
                               launcher_ms=[220.0], launcher_median_ms=220.0)}
    path_a, path_b = tmp_path / "a.json", tmp_path / "b.json"
    path_a.write_text(json.dumps({"summary": summary}))
    path_b.write_text(json.dumps({"summary": with_launcher}))
    data = _module().panels([path_a, path_b])
    assert data[("nvlink", "Megatron-LM no_overlap")] == [
        ("stock", 224.0, 216.8, 231.2), ("patched", 227.9, 222.8, 233.0)]
    assert [r[0] for r in data[("nvlink", "Megatron-LM overlap_grad")]] == [
        "stock", "patched", "launcher"]


def test_an_interleaved_megatron_launch_gives_its_iterations_median_and_deciles(tmp_path):
    summary = {"nvlink/distopt_overlap": {
        "regime": "nvlink", "setting": "distopt_overlap", "stock_ms": [330.0],
        "stock_median_ms": 330.0, "patched_ms": [],
        "interleaved_stock_ms": [float(v) for v in range(300, 311)],       # 300..310
        "interleaved_patched_ms": [float(v) for v in range(301, 312)]}}     # 301..311
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"summary": summary}))
    rows = _module().panels([path])[("nvlink", "Megatron-LM distopt_overlap")]
    assert rows[0] == ("stock", 330.0, 330.0, 330.0)
    assert rows[1] == ("interleaved stock (iterations: median, p10-p90)", 305.0, 301.0, 309.0)
    assert rows[2][0].startswith("interleaved patched") and rows[2][1:] == (306.0, 302.0, 310.0)
    proc, out = _plot(tmp_path, [{"summary": summary}])
    assert proc.returncode == 0, proc.stderr


def test_long_labels_keep_the_end_that_tells_sweep_modes_apart():
    module = _module()
    a = "6s data-parallel mode, partition off, credit 2 layer groups, groups 128M"
    b = "6s data-parallel mode, partition off, credit 2 layer groups, groups 64M"
    short_a, short_b = module._short_label(a), module._short_label(b)
    assert len(short_a) == 60 and len(short_b) == 60
    assert short_a.startswith("6s data-parallel") and short_a.endswith("groups 128M")
    assert short_b.endswith("groups 64M")
    assert module._short_label("4 DDP default (25 MiB buckets)") == "4 DDP default (25 MiB buckets)"
