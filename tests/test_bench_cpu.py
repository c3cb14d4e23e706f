"""The CPU benchmark script runs (tiny sizes): every benchmark completes and the CSV has
the shared schema.  (Its numbers are read from its own runs, never asserted here.)"""
import csv
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(os.environ.get("POCO_KERNELS_NO_EXTENSION") == "1",
                    reason="the script benchmarks the C++ backend")
def test_bench_cpu_runs_and_writes_the_schema(tmp_path, monkeypatch):
    pytest.importorskip("ivon")
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    sys.modules.pop("common", None)
    import bench_cpu
    import common
    code = bench_cpu.main(["--sizes", "3001", "--reps", "2", "--max-s", "1", "--copy-mib", "4",
                           "--rotate-mib", "4", "--dtypes", "float32", "--out", str(tmp_path)])
    assert code & 4 == 0, "a benchmark raised"
    with open(tmp_path / "bench_cpu.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == common.CSV_FIELDS
    got = {(r["kernel"], r["provider"]) for r in rows}
    for need in [("copy", "torch.Tensor.copy_"), ("step_kernel_poco", "poco_kernels.cpp(direct)"),
                 ("ivon_poco_step", "poco_kernels.cpp"), ("ivon_poco_step", "poco_kernels.torch"),
                 ("ivon_cycle", "ivon-opt-0.1.3"), ("adamw_step", "torch.AdamW(fused)")]:
        assert need in got, need
    assert all(float(r["median"]) > 0 for r in rows)
    assert (tmp_path / "bench_cpu_table.txt").exists()
