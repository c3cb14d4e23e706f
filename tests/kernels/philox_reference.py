"""An independent reference for the noise tests (``test_noise_*.py``): Philox4x32-10 in
plain Python ints, written in the Random123 style (mulhilo on full-width Python ints, key
bump between rounds) rather than mirroring the module's code, and the normals of a
stream's element on it."""
import numpy as np

MASK32 = 0xFFFFFFFF


def ref_philox(ctr, key, rounds=10):
    m0, m1 = 0xD2511F53, 0xCD9E8D57  # PHILOX_M4x32_0, PHILOX_M4x32_1
    w0, w1 = 0x9E3779B9, 0xBB67AE85  # PHILOX_W32_0, PHILOX_W32_1
    x = list(ctr)
    k = list(key)
    for r in range(rounds):
        if r:  # Random123 bumps the key before every round but the first
            k = [(k[0] + w0) & MASK32, (k[1] + w1) & MASK32]
        p0 = m0 * x[0]
        p1 = m1 * x[2]
        x = [(p1 >> 32) ^ x[1] ^ k[0], p1 & MASK32, (p0 >> 32) ^ x[3] ^ k[1], p0 & MASK32]
    return tuple(x)


def ref_randn(seed, index, step, stream, version=2):
    """Element ``index`` of a stream on the reference Philox, with numpy float32 math:
    version 2 lane ``index % 4`` of call ``index // 4`` (``tl.randn4x``), version 1 the
    cosine branch of call ``index`` (``tl.randn``)."""
    call, lane = (index >> 2, index & 3) if version == 2 else (index, 0)
    o = ref_philox((call & MASK32, call >> 32, step, stream), (seed & MASK32, seed >> 32))

    def uniform(w):
        x = w - 2**32 if w >= 2**31 else w  # bitcast to int32
        x = -x - 1 if x < 0 else x
        return np.float32(x) * np.float32(4.6566127342e-10)

    pair = 2 * (lane >> 1)            # words (0, 1) for lanes 0, 1; (2, 3) for lanes 2, 3
    u1 = max(np.float32(1e-7), uniform(o[pair]))
    th = np.float32(6.283185307179586) * uniform(o[pair + 1])
    r = np.sqrt(np.float32(-2.0) * np.log(u1))
    return float(r * (np.sin(th) if lane & 1 else np.cos(th)))
