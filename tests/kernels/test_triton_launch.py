"""The Triton launches that skip the JIT's binding (``kernels/triton_launch.py``): their
cache key is at least as fine as Triton's own specialisation, and the arguments they
hand the compiled kernel are the ones Triton's binder would, for every launch the
optimizers make.  (The launch itself needs a GPU: the quick GPU check compares it with
the JIT's bit for bit, ``benchmarks/gpu/quick.py``'s ``launch`` section.)"""
import itertools

import pytest
import torch

from helpers import FUSED_BACKENDS

pytestmark = pytest.mark.skipif("triton" not in FUSED_BACKENDS, reason="Triton is not here")


def _launch():
    from poco_kernels.kernels import triton_launch
    return triton_launch


def _arguments():
    """Arguments of every kind the kernels take, at the edges of Triton's
    specialisations: integers around 0, 1, 16 and the 32- and 64-bit limits, tensors of
    several dtypes at addresses aligned to 16 bytes and not."""
    ints = [0, 1, 2, 15, 16, 17, 32, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 1,
            -2**31, -2**31 - 1, -2**31 - 16, 2**32, 2**63 - 16, 2**63 - 1, 2**63, 2**64 - 16,
            2**64 - 1]
    base = [torch.zeros(64, dtype=d) for d in (torch.float32, torch.bfloat16, torch.int64,
                                                torch.int32, torch.float16)]
    tensors = [t[k:] for t in base for k in (0, 1, 2, 4, 8)]
    return ints + tensors + [True, False, None, 0.0, 1.0, 0.5, -3.25]


def _triton_spec(a):
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    return native_specialize_impl(BaseBackend, a, False, True, True)


def test_key_is_at_least_as_fine_as_tritons_specialisation():
    """Two arguments with the same key have the same specialisation in Triton (so a
    cached kernel is the one the JIT would pick), and the key does tell apart what
    Triton tells apart: 1 from other integers, aligned from unaligned addresses, i32
    from i64 from u64, dtypes."""
    L = _launch()
    args = _arguments()
    for a, b in itertools.combinations(args, 2):
        if L.spec(a) == L.spec(b):
            assert _triton_spec(a) == _triton_spec(b), (a, b)
    distinct = {L.spec(a) for a in args}
    assert len(distinct) >= len({_triton_spec(a) for a in args})


@pytest.mark.parametrize("value", ["a string", [1], (1,), 1j, torch.float32])
def test_an_argument_of_another_type_is_not_keyed(value):
    L = _launch()
    with pytest.raises(L._Unkeyed):
        L.spec(value)


def _record_launches(monkeypatch):
    """Run the optimizers' launches (IVON-PoCoMo with a refresh, bfloat16 state, AMP's
    found_inf, the bad-gradient check, autograd's gradients read in place, the noise) under the interpreter, recording each
    launch's (launcher, args, kwargs)."""
    L = _launch()
    import poco_kernels as pk
    from poco_kernels.kernels import triton_ops
    seen = []
    real = L.Launcher.launch

    def recording(self, grid, args, kwargs):
        seen.append((self, args, dict(kwargs)))
        return real(self, grid, args, kwargs)
    monkeypatch.setattr(L.Launcher, "launch", recording)
    g = torch.Generator().manual_seed(3)
    for state_dtype, views in ((None, True), (torch.bfloat16, False)):
        ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in (37, 5)]
        opt = pk.IVONPoCoMo(ps, lr=0.05, ess=100.0, hess_init=0.1, alpha=0.7,
                            backend="triton", state_dtype=state_dtype, grad_views=views)

        def closure():
            opt.zero_grad()
            loss = sum((p * p).sum() for p in ps)
            loss.backward()
            return loss
        opt.refresh([closure])
        opt.step(closure)
        opt.step(closure, grad_scale=torch.ones(()), found_inf=torch.zeros(()))
    triton_ops.randn(torch.empty(33), 7, 2, 5, offset=3)
    return seen


def test_bound_arguments_are_the_binders(monkeypatch):
    """For every launch the optimizers make, the positional arguments and the
    launcher's tail (keywords and defaults in signature order) are exactly the bound
    arguments Triton's binder passes to a compiled kernel."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import JITFunction, create_function_from_signature
    seen = _record_launches(monkeypatch)
    kernels = {launcher.fn.fn.__name__ for launcher, _, _ in seen}
    assert {"sample_kernel", "accumulate_kernel", "check_kernel", "step_kernel",
            "refresh_kernel", "finish_kernel", "randn_kernel"} <= kernels, kernels
    binders = {}
    for launcher, args, kwargs in seen:
        fn = launcher.fn.fn
        if fn not in binders:
            jf = JITFunction(fn)
            binders[fn] = create_function_from_signature(jf.signature, jf.params, BaseBackend)
        bound, _, options = binders[fn](*args, **kwargs)
        ours = list(args) + list(launcher.tail(args, kwargs))
        assert len(ours) == len(bound), fn.__name__
        for name, x, y in zip(bound, bound.values(), ours):
            assert x is y or (type(x) is type(y) and x == y), (fn.__name__, name, x, y)
        assert set(options) <= {"num_warps", "num_stages", "enable_fp_fusion"}
        assert kwargs.keys() <= launcher._keywords, fn.__name__


def test_the_interpreter_goes_through_the_jit(monkeypatch):
    """Without a GPU build (the interpreter here) every launch is the JIT's: nothing is
    cached, and the results are the interpreter's."""
    seen = _record_launches(monkeypatch)
    for launcher, _, _ in seen:
        assert not launcher._fast and launcher.cache == {} and launcher.hits == 0
