"""The kernel before/after study (``benchmarks/studies/kernel_ab.py``): it refuses two trees
whose kernel interfaces differ, and builds and runs both trees' kernels in one binary.
(Speed is read from the study's own runs, never asserted here.)"""
import csv
import os
import shutil
import subprocess

import pytest

from benchmarks.studies import kernel_ab

HEADER = """// The interface.
namespace poco {
constexpr int64_t kTile = 128;
struct Noise {
  uint64_t seed;   // the key
  uint32_t counter;
};
}
"""


def test_the_interface_ignores_comments_and_the_tile_size_and_sees_a_field():
    base = kernel_ab.interface(HEADER)
    assert kernel_ab.interface(HEADER.replace("// the key", "// the Philox key")) == base
    assert kernel_ab.interface(HEADER.replace("kTile = 128", "kTile = 64")) == base
    assert kernel_ab.interface(HEADER.replace("uint32_t counter;",
                                              "uint32_t counter;\n  uint32_t stream;")) != base
    assert kernel_ab.interface(HEADER.replace("uint32_t counter", "uint64_t counter")) != base


def _git_checkout() -> bool:
    return shutil.which("git") is not None and subprocess.run(
        ["git", "-C", kernel_ab.REPO, "rev-parse", "HEAD"], capture_output=True).returncode == 0


@pytest.mark.long
@pytest.mark.skipif(not _git_checkout(), reason="needs the repository's git history")
def test_the_study_builds_both_trees_and_times_every_case(tmp_path):
    out = tmp_path / "ab.csv"
    rows = kernel_ab.main(["--base", "HEAD", "--numel", "4099", "--reps", "3",
                           "--threads", "2", "--out", str(out)])
    cases = {"step_ivon_next", "step_poco_next", "step_poco", "sample_outer", "noise_stream"}
    assert {r["case"] for r in rows} == cases
    for r in rows:
        assert r["reps"] == 3 and r["base_ms"] > 0 and r["work_ms"] > 0 and r["ratio"] > 0
    with open(out) as f:
        written = list(csv.DictReader(f))
    assert len(written) == 2 * len(cases)
    assert {w["provider"] for w in written} == {f"kernels@{_short('HEAD')}", "kernels@work tree"}
    for w in written:
        assert float(w["p20"]) <= float(w["median"]) <= float(w["p80"])
    assert os.path.exists(tmp_path / "ab.md")


def _short(rev):
    return subprocess.run(["git", "-C", kernel_ab.REPO, "rev-parse", "--short", rev],
                          capture_output=True, text=True).stdout.strip()


def test_a_revision_that_does_not_exist_is_refused(tmp_path):
    if not _git_checkout():
        pytest.skip("needs the repository's git history")
    with pytest.raises(RuntimeError, match="git archive"):
        kernel_ab.build("no-such-revision-0123", "avx2", str(tmp_path / "w"), "c++")
