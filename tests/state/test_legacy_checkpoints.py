"""A checkpoint written before the architecture change (033f673, at commit 720fa9a) loads
and resumes bit for bit: see ``tests/state/legacy_checkpoints.py``.  It runs in a subprocess so
that ATen and the C++ kernels can be pinned to AVX2 before torch loads (the bits then do
not depend on the CPU)."""
import os
import subprocess
import sys

import pytest

import legacy_checkpoints as L
from helpers import available_backends


def test_checkpoints_from_720fa9a_resume_bit_for_bit():
    if "cpp" not in available_backends():
        pytest.fail("the C++ extension is not built (tests/kernels/test_cpp_backend.py says why)")
    if "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("the recorded bits are AVX2's; this CPU has no AVX2")
    env = {**os.environ, **L.ENV}
    r = subprocess.run([sys.executable, L.__file__, "check"], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok: 13 cases" in r.stdout
