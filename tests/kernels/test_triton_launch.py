"""The Triton launches that skip the JIT's binding (``kernels/triton_launch.py``): their
cache key is at least as fine as Triton's own specialisation, the arguments they hand
the compiled kernel are the ones Triton's binder would for every launch the optimizers
make, and the cache (driven here with a stand-in driver and compiled kernel) launches a
kept kernel exactly when the key matches and sends every other call to the JIT.  (A real
launch needs a GPU: the quick GPU check compares the cached launches with the JIT's bit
for bit, ``benchmarks/gpu/checks.py``'s ``check_launch``.)"""
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


# --------------------------------------------------------------------------- the cache
class _Compiled:
    """A stand-in compiled kernel: records its launches."""

    def __init__(self, compiled_for):
        self.compiled_for = compiled_for
        self.function, self.packed_metadata = object(), object()
        self.launches = []

    def launch_metadata(self, grid, stream, *args):
        return ("metadata", grid, stream)

    def run(self, *args):
        self.launches.append(args)


class _Driver:
    """A stand-in for Triton's active driver: the stream of device d is 1000 + d."""

    @staticmethod
    def get_current_stream(device):
        return 1000 + device


def _source(x_ptr, n, FLAG, B=4):                  # (its annotations are added below)
    pass


@pytest.fixture
def rig(monkeypatch):
    """(launcher, jit calls, device setter, tensor) over a JITFunction whose JIT is a
    stand-in: each call through the JIT returns a new :class:`_Compiled` and is recorded."""
    import types
    import triton
    import triton.language as tl
    from triton.runtime.jit import JITFunction
    L = _launch()
    _source.__annotations__ = {"FLAG": tl.constexpr, "B": tl.constexpr}
    fn = JITFunction(_source)
    jit_calls = []

    def run(*args, grid, warmup, **kwargs):
        jit_calls.append((grid, args, kwargs))
        return _Compiled((args, kwargs))
    monkeypatch.setattr(fn, "run", run)
    monkeypatch.setattr(L, "fast_path_available", lambda: True)
    monkeypatch.setattr(triton.runtime.driver, "_active", _Driver())
    device = [0]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: device[0])
    module = types.SimpleNamespace(k=fn)
    launcher = L.Launcher(module, "k")
    x = torch.zeros(64)

    def set_device(d):
        device[0] = d
    return launcher, jit_calls, set_device, x, module


def test_a_matching_key_launches_the_kept_kernel(rig):
    """The second launch with the same key runs the kernel the JIT returned the first
    time, with the JIT's launch arguments: the grid padded to three, the current
    stream, the kernel's handles, the hooks, then every bound argument (the default of
    B included)."""
    from triton import knobs
    launcher, jit_calls, _, x, _ = rig
    first = launcher[(3,)](x, 16, FLAG=True, num_warps=4)
    again = launcher[(5, 2)](x, 32, FLAG=True, num_warps=4)
    assert again is first and len(jit_calls) == 1
    assert (launcher.hits, launcher.misses) == (1, 1)
    (run,) = first.launches
    assert run[:3] == (5, 2, 1) and run[3] == 1000
    assert run[4] is first.function and run[5] is first.packed_metadata
    assert run[6] == ("metadata", (5, 2), 1000)
    assert run[7] is knobs.runtime.launch_enter_hook
    assert run[8] is knobs.runtime.launch_exit_hook
    assert run[9] is x and run[10:] == (32, True, 4)


@pytest.mark.parametrize("change", [
    "n not a multiple of 16", "n equal to 1", "n in 64 bits", "unaligned tensor",
    "other dtype", "constexpr value", "constexpr type", "num_warps", "device", "debug knob"])
def test_what_triton_specialises_on_changes_the_key(rig, monkeypatch, change):
    """Each thing the JIT compiles a new variant for sends the launch to the JIT (and
    keeps its kernel under a new key); the kernel kept before is not launched."""
    from triton import knobs
    launcher, jit_calls, set_device, x, _ = rig
    base = dict(args=(x, 16), kwargs=dict(FLAG=True, num_warps=4))
    kept = launcher[(1,)](*base["args"], **base["kwargs"])
    args, kwargs = base["args"], dict(base["kwargs"])
    if change == "n not a multiple of 16":
        args = (x, 17)
    elif change == "n equal to 1":
        args = (x, 1)
    elif change == "n in 64 bits":
        args = (x, 2 ** 32)
    elif change == "unaligned tensor":
        args = (x[1:], 16)
    elif change == "other dtype":
        args = (x.to(torch.float64), 16)
    elif change == "constexpr value":
        kwargs["FLAG"] = False
    elif change == "constexpr type":
        kwargs["FLAG"] = 1
    elif change == "num_warps":
        kwargs["num_warps"] = 8
    elif change == "device":
        set_device(1)
    else:
        monkeypatch.setattr(knobs.runtime, "debug", not knobs.runtime.debug)
    launcher[(1,)](*args, **kwargs)
    assert len(jit_calls) == 2 and launcher.misses == 2 and launcher.hits == 0
    assert kept.launches == [] and len(launcher.cache) == 2


@pytest.mark.parametrize("case", [
    "constexpr by position", "callable grid", "float keyword", "unknown argument",
    "unknown keyword", "disabled", "not available"])
def test_unkeyed_launches_go_through_the_jit(rig, monkeypatch, case):
    """Launches the key cannot describe go through the JIT every time, and nothing is
    cached for them."""
    L = _launch()
    launcher, jit_calls, _, x, _ = rig
    args, kwargs, grid = (x, 16), dict(FLAG=True), (1,)
    if case == "constexpr by position":
        args = (x, 16, True)
        kwargs = {}
    elif case == "callable grid":
        grid = lambda meta: (1,)                    # noqa: E731
    elif case == "float keyword":
        kwargs["B"] = 2.0
    elif case == "unknown argument":
        args = (x, "sixteen")
    elif case == "unknown keyword":
        kwargs["extra"] = 1
    elif case == "disabled":
        monkeypatch.setattr(L, "ENABLED", False)
    else:
        monkeypatch.setattr(L, "fast_path_available", lambda: False)
    for _ in range(3):
        launcher.launch(grid, args, kwargs)
    assert len(jit_calls) == 3 and launcher.cache == {}
    assert launcher.hits == launcher.misses == 0


def test_a_replaced_kernel_starts_a_new_cache(rig, monkeypatch):
    """A kernel replaced in its module (a test's spy) is the one launched, with a cache
    of its own."""
    from triton.runtime.jit import JITFunction
    launcher, jit_calls, _, x, module = rig
    launcher[(1,)](x, 16, FLAG=True)
    launcher[(1,)](x, 16, FLAG=True)
    assert launcher.hits == 1
    other = JITFunction(_source)
    seen = []
    monkeypatch.setattr(other, "run", lambda *a, grid, warmup, **k: seen.append(a) or
                        _Compiled((a, k)))
    module.k = other
    launcher[(1,)](x, 16, FLAG=True)
    assert len(seen) == 1 and len(jit_calls) == 1 and launcher.fn is other
    assert (launcher.hits, launcher.misses) == (0, 1)


def test_each_device_launches_on_its_current_stream(rig):
    """A kernel kept for device 1 is launched there on device 1's current stream."""
    launcher, jit_calls, set_device, x, _ = rig
    set_device(1)
    kept = launcher[(1,)](x, 16, FLAG=True)
    launcher[(1,)](x, 16, FLAG=True)
    assert len(jit_calls) == 1 and kept.launches[0][3] == 1001


def test_making_a_launcher_needs_no_driver(monkeypatch):
    """A launcher is made at import (``triton_ops``) where Triton may have no driver (no
    GPU, no interpreter): nothing asks the driver before the first launch."""
    import triton
    from triton.runtime.jit import JITFunction
    L = _launch()

    class NoDriver:
        def __getattr__(self, name):
            raise RuntimeError("0 active drivers")
    monkeypatch.setattr(triton.runtime.driver, "_active", NoDriver())
    monkeypatch.setattr(L, "fast_path_available", lambda: True)
    import types
    launcher = L.Launcher(types.SimpleNamespace(k=JITFunction(_source)), "k")
    assert launcher._fast is None and launcher.cache == {}
