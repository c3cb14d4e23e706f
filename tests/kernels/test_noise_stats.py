"""Statistics of the noise stream (version 2, four normals per Philox call), on 2**24 draws
from the kernels' own generator (the C++ stream operator; the torch reference where the
extension is not built: ``tests/kernels/test_kernels_noise.py`` shows the two agree to ~1e-6).

Each check compares a statistic with its sampling distribution under the null (independent
standard normals) and fails beyond ``Z`` standard errors, or beyond the Kolmogorov-Smirnov
critical value at ``ALPHA``: for a correct generator the chance of a false failure is
below 1e-8 per check (the draws are fixed by their seeds, so a pass is reproducible).  The
checks are also run on broken generators, built from the same Philox words with one
defect each (a duplicated Box-Muller branch, a lane fed the wrong word pair, a stream or
step that is ignored, neighbouring calls that repeat, a wrong uniform map): each must be
caught, so the thresholds are shown to have teeth.
"""
import math

import pytest
import torch

from helpers import available_backends
from poco_kernels import noise

N = 2 ** 24          # draws per stream (4 * 2**22: 2**22 per lane)
Z = 6.0              # standard errors (two-sided p ~ 2e-9)
ALPHA = 1e-8         # Kolmogorov-Smirnov level
SEED = 0x5EED_0F_4A11


def _draw(n, seed, step, stream, offset=0, version=noise.STREAM_VERSION):
    """float64 draws of the stream, from the C++ kernels' generator where built."""
    if "cpp" in available_backends():
        from poco_kernels.kernels import cpp_ops
        out = cpp_ops.randn(torch.empty(n), seed, step, stream, offset, version)
    else:
        out = noise.randn(n, seed, step, stream, offset=offset, version=version)
    return out.double()


@pytest.fixture(scope="module")
def stream():
    return _draw(N, SEED, 3, noise.stream_id(1, 0, 0))


# --------------------------------------------------------------------------- the checks
def _corr(a, b):
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).mean() / (a.std() * b.std()))


def check_moments(x, what):
    """Mean, variance, third and fourth moments of each lane (standard errors of the
    sample moments of N(0, 1): 1, sqrt(2), sqrt(15), sqrt(96) over sqrt(n))."""
    lanes = x.view(-1, 4)
    n = lanes.shape[0]
    for lane in range(4):
        v = lanes[:, lane]
        for name, stat, expect, se in (("mean", v.mean(), 0.0, 1.0),
                                       ("variance", (v * v).mean(), 1.0, math.sqrt(2.0)),
                                       ("third moment", (v ** 3).mean(), 0.0, math.sqrt(15.0)),
                                       ("fourth moment", (v ** 4).mean(), 3.0, math.sqrt(96.0))):
            z = (float(stat) - expect) / (se / math.sqrt(n))
            assert abs(z) < Z, f"{what}: lane {lane} {name} {float(stat):.5f} is {z:.1f} s.e. off"


def check_ks(x, what):
    """Kolmogorov-Smirnov distance of each lane's empirical CDF from the normal CDF."""
    lanes = x.view(-1, 4)
    n = lanes.shape[0]
    crit = math.sqrt(-0.5 * math.log(ALPHA / 2) / n)
    for lane in range(4):
        v, _ = torch.sort(lanes[:, lane])
        cdf = torch.special.ndtr(v)
        i = torch.arange(1, n + 1, dtype=torch.float64)
        d = float(torch.maximum(i / n - cdf, cdf - (i - 1) / n).max())
        assert d < crit, f"{what}: lane {lane} KS distance {d:.2e} > {crit:.2e}"


def check_pairs(pairs, what, n_eff):
    """Correlation of values and of squares (dependence that leaves values uncorrelated,
    e.g. a shared Box-Muller radius) of each pair, standard error 1/sqrt(n_eff)."""
    bound = Z / math.sqrt(n_eff)
    for name, a, b in pairs:
        for kind, u, v in (("values", a, b), ("squares", a * a, b * b)):
            c = _corr(u, v)
            assert abs(c) < bound, f"{what}: {name} correlation of {kind} {c:.2e} > {bound:.1e}"


def check_lanes(x, what):
    """Between the four lanes of each call (lanes 0 and 1 share a radius, so only the
    correlation of squares can see a broken transform there)."""
    lanes = x.view(-1, 4)
    pairs = [(f"lanes {a}/{b}", lanes[:, a], lanes[:, b])
             for a in range(4) for b in range(a + 1, 4)]
    check_pairs(pairs, what, lanes.shape[0])


def check_neighbours(x, what):
    """Between neighbouring elements (lag 1, across call boundaries: lane 3 of call q and
    lane 0 of call q + 1, and lag 4: the same lane of neighbouring calls)."""
    lanes = x.view(-1, 4)
    pairs = [("lag 1", x[:-1], x[1:]),
             ("call boundary", lanes[:-1, 3], lanes[1:, 0]),
             ("lag 4", x[:-4], x[4:])]
    check_pairs(pairs, what, lanes.shape[0] - 1)


def check_independent(x, y, what):
    """Two streams that must be independent (other stream id, step or seed)."""
    check_pairs([("element-wise", x, y)], what, x.numel())


# --------------------------------------------------------------------------- the stream
def test_moments_per_lane(stream):
    check_moments(stream, "v2")


def test_kolmogorov_smirnov_per_lane(stream):
    check_ks(stream, "v2")


def test_lanes_independent(stream):
    check_lanes(stream, "v2")


def test_neighbours_independent(stream):
    check_neighbours(stream, "v2")


def test_streams_steps_and_seeds_independent(stream):
    n = N // 4
    x = stream[:n]
    for what, y in (("other stream", _draw(n, SEED, 3, noise.stream_id(1, 0, 1))),
                    ("other bucket", _draw(n, SEED, 3, noise.stream_id(2, 0, 0))),
                    ("next step", _draw(n, SEED, 4, noise.stream_id(1, 0, 0))),
                    ("other seed", _draw(n, SEED + 1, 3, noise.stream_id(1, 0, 0))),
                    ("far offset", _draw(n, SEED, 3, noise.stream_id(1, 0, 0), offset=N))):
        check_independent(x, y, what)


def test_the_v1_stream_passes_the_same_checks():
    """The stream of old checkpoints (one normal per call) is held to the same checks."""
    x = _draw(N // 4, SEED, 3, 5, version=1)
    check_moments(x, "v1")
    check_neighbours(x, "v1")


# --------------------------------------------------------------------------- teeth
N_BROKEN = 2 ** 18   # draws of a broken generator (built on the slower torch reference)


def _words(q, seed, step, stream):
    """The uniforms of the four Philox words of calls q (the reference's building blocks)."""
    w = noise.philox4x32(seed, q & 0xFFFFFFFF, q >> 32, step, stream)
    return [noise._uint_to_uniform_float(v).double() for v in w]


def _box_muller(u1, u2):
    r = torch.sqrt(-2.0 * torch.log(u1.clamp_min(1e-7)))
    th = 2 * math.pi * u2
    return r * torch.cos(th), r * torch.sin(th)


def _broken(defect, n, seed=SEED, step=3, stream=7):
    """A version-2-like stream of n draws with one defect."""
    q = torch.arange(n // 4, dtype=torch.int64)
    if defect == "neighbouring calls repeat":
        q = q // 2 * 2
    if defect == "step ignored":
        step = 3
    if defect == "stream ignored":
        stream = 7
    u = _words(q, seed, step, stream)
    if defect == "uniform not folded":         # the words read as int32 without the fold
        w = noise.philox4x32(seed, q & 0xFFFFFFFF, q >> 32, step, stream)
        u = [(torch.where(v >= 2 ** 31, v - 2 ** 32, v) * 4.6566127342e-10).double() for v in w]
    a, b = _box_muller(u[0], u[1])
    c, d = _box_muller(u[2], u[3])
    if defect == "branch duplicated":
        b = a
    if defect == "lane fed the wrong word pair":
        c, d = _box_muller(u[1], u[0])         # words (1, 0) instead of (2, 3)
    return torch.stack([a, b, c, d], dim=1).reshape(-1)


@pytest.mark.parametrize("defect, check", [
    ("branch duplicated", check_lanes),
    ("lane fed the wrong word pair", check_lanes),
    ("neighbouring calls repeat", check_neighbours),
    ("uniform not folded", check_ks),
])
def test_a_broken_generator_fails(defect, check):
    x = _broken(defect, N_BROKEN)
    with pytest.raises(AssertionError):
        check(x, defect)
    check(_broken("none", N_BROKEN), "the unbroken twin")    # the same code without it passes


@pytest.mark.parametrize("defect", ["step ignored", "stream ignored"])
def test_an_ignored_counter_is_caught(defect):
    n = N_BROKEN
    x = _broken("none", n)
    other = {"step": 4} if defect == "step ignored" else {"stream": 8}
    with pytest.raises(AssertionError):        # asked for another step / stream
        check_independent(x, _broken(defect, n, **other), defect)
    check_independent(x, _broken("none", n, **other), "the unbroken twin")
