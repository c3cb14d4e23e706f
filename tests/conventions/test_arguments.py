"""Constructor arguments declared once (poco_kernels/_arguments.py): every optimizer's
signature, defaults, ``help()`` text and ``from_ivon`` keywords follow from its
declarations, and a declaration that static tools would misread is refused."""
from __future__ import annotations

import inspect
import pydoc
import typing

import pytest
import torch

import poco_kernels as pk
from poco_kernels import _arguments as A
from optim_db import infos

P = inspect.Parameter
CLASSES = [i.cls for i in infos()]


def _params():
    return [torch.nn.Parameter(torch.randn(3))]


def _required(cls):
    return {n: 1.0 for n, a in cls._arguments.items() if a.required and n != "params"}


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_signature_is_the_declarations(cls):
    """``inspect.signature`` (what ``help()``, IPython and debuggers show) lists the declared
    arguments in order: ``params``, the hyperparameters (positional), the options
    (keyword-only), each with its declared default."""
    sig = inspect.signature(cls)
    args = cls._arguments
    assert list(sig.parameters) == list(args)
    assert next(iter(args)) == "params"
    for name, p in sig.parameters.items():
        a = args[name]
        assert p.kind is (P.KEYWORD_ONLY if a.kind == "option" else P.POSITIONAL_OR_KEYWORD)
        if a.required:
            assert p.default is P.empty, name
        else:
            assert p.default == a.default, name
        assert p.annotation is not P.empty, name
    assert {"seed", "backend", "check_finite", "grad_views"} <= {
        n for n, a in args.items() if a.kind == "option"}


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_defaults_are_the_declared_hyperparameters(cls):
    """What the constructor puts in ``defaults`` (and so in every parameter group) is each
    declared hyperparameter, with its declared default, and nothing else."""
    opt = cls(_params(), **_required(cls))
    hyper = {n: a for n, a in cls._arguments.items() if a.kind == "hyperparameter"}
    assert list(opt.defaults) == list(hyper)
    for n, a in hyper.items():
        want = 1.0 if a.required else (a.convert or (lambda v: v))(a.default)
        assert opt.defaults[n] == want and opt.param_groups[0][n] == want, n
    assert isinstance(opt.defaults.get("betas", ()), tuple)   # (SVRGAdamW's convert)



@pytest.mark.parametrize("value", [0.9, None, (0.9,), (0.9, 0.999, 0.5)], ids=repr)
def test_betas_that_are_no_pair_are_refused_by_name(value):
    """SVRGAdamW's ``betas`` given as a scalar, None or a tuple of the wrong length: a
    ValueError that names ``betas`` (the constructor's conversion to a tuple lets the
    group's check speak; it had raised "'float' object is not iterable").  IVON's
    constructor takes ``beta1``/``beta2``; its groups' ``betas`` alias is checked in
    test_torch_lr_and_groups.py."""
    with pytest.raises(ValueError, match="betas"):
        pk.SVRGAdamW(_params(), betas=value)

def test_positional_arguments_land_where_the_signature_says():
    """A positional call reaches the right hyperparameter (IVONPoCoMo: 19 of them)."""
    names = [n for n, a in pk.IVONPoCoMo._arguments.items() if a.kind == "hyperparameter"]
    values = [0.5, 100.0, 0.7, 0.8, 0.9, 0.01, 2, 3.0, False, False, 0.4, 0.3, 0.2, 0.05,
              "independent", 2, True, 0.5]
    opt = pk.IVONPoCoMo(_params(), *values, seed=1, backend="torch")
    assert [opt.defaults[n] for n in names] == values
    assert opt.seed == 1 and opt.backend == "torch"
    with pytest.raises(TypeError):
        pk.IVONPoCoMo(_params(), *values, 1)          # options are keyword-only


def test_help_shows_each_class_its_own_defaults():
    """``help()`` documents every argument of all three IVON classes, with the class's own
    default (IVONPoCoMo's rho1 = 0.6, IVONPoCo's 0.0), from one declaration each."""
    texts = {c: pydoc.render_doc(c, renderer=pydoc.plaintext)
             for c in (pk.IVON, pk.IVONPoCo, pk.IVONPoCoMo)}
    for cls, text in texts.items():
        assert "{arguments}" not in cls.__doc__
        for name, a in cls._arguments.items():
            shown = "required" if a.required else f"default ``{a.default!r}``"
            assert f"* ``{name}`` ({shown}):" in cls.__doc__, (cls.__name__, name)
    assert "rho1: float = 0.6" in texts[pk.IVONPoCoMo]          # the signature help() shows
    assert "rho1: float = 0.0" in texts[pk.IVONPoCo]
    assert "* ``rho1`` (default ``0.6``)" in pk.IVONPoCoMo.__doc__
    assert "* ``rho1`` (default ``0.0``)" in pk.IVONPoCo.__doc__
    assert "``alpha``" not in pk.IVON.__doc__.split("Per parameter group")[1]
    # the documentation is written once: the same text in all three
    for name in pk.IVON._arguments:
        assert len({c._arguments[name].doc for c in texts}) == 1


def test_svrg_and_vsgd_declare_sgd_alike():
    """VSGD-PoCo restates SGD's hyperparameters (its signature puts ``sigma`` second, so it
    cannot inherit SVRG's order): the two declarations must agree."""
    for name, a in pk.SVRG._arguments.items():
        b = pk.VSGDPoCo._arguments[name]
        assert (a.kind, a.default, a.doc, a.annotation) == (b.kind, b.default, b.doc,
                                                            b.annotation), name


def test_from_ivon_takes_the_declared_correction_keywords():
    keys = pk.IVONPoCoMo._continuation_keywords()
    assert "alpha" in keys and "hess_floor" in keys and "seed" in keys and "state_dtype" in keys
    assert "lr" not in keys and "params" not in keys
    ivon = pk.IVON(_params(), lr=0.1, ess=10.0, beta1=0.8, seed=3, backend="torch")
    with pytest.raises(TypeError, match="'beta1'.*takes alpha, rho1"):
        pk.IVONPoCoMo.from_ivon(ivon, beta1=0.5)
    opt = pk.IVONPoCoMo.from_ivon(ivon, alpha=0.5)
    assert opt.defaults["beta1"] == 0.8 and opt.defaults["alpha"] == 0.5
    assert opt.defaults["rho1"] == 0.6 and opt.seed == 3


def test_static_tools_read_the_same_declarations():
    """pyright/Pylance synthesise the signature from ``dataclass_transform``: the root
    carries it, with the three field specifiers (a class attribute they would misread is
    refused, below)."""
    spec = A.DeclaredArguments.__dataclass_transform__
    assert set(spec["field_specifiers"]) == {A.argument, A.hyperparameter, A.option}
    assert issubclass(pk.IVON, A.DeclaredArguments)
    assert typing.get_type_hints(pk.IVON.__init__)["lr"] is float


def _subclass(body: dict, annotations: dict, base=pk.IVON, module="poco_kernels.fake"):
    ns = dict(body, __annotations__=annotations, __module__=module)
    return type("Sub", (base,), ns)


def test_bad_declarations_are_refused():
    with pytest.raises(TypeError, match="ClassVar"):
        _subclass({"note": 1}, {"note": "int"})
    _subclass({"note": 1}, {"note": "ClassVar[int]"})
    _subclass({"note": 1}, {"note": "int"}, module="user_code")     # a user's own class
    with pytest.raises(TypeError, match="after 'hess_init'"):
        _subclass({"extra": A.hyperparameter(doc="x")}, {"extra": "float"})
    with pytest.raises(TypeError, match="declared as option, inherited as hyperparameter"):
        _subclass({"lr": A.option(default=1.0, doc="x")}, {"lr": "float"})
    with pytest.raises(ValueError, match="documented"):
        A.hyperparameter(default=1.0, doc=" ")
    with pytest.raises(ValueError, match="keyword-only"):
        A.option(default=1.0, doc="x", kw_only=False)


def test_a_redeclared_default_and_an_own_init():
    """A subclass changes an inherited default in place; one that writes ``__init__``
    keeps it (and the unknown-keyword check still wraps it)."""
    Sub = _subclass({"beta1": 0.5}, {"beta1": "float"})
    assert list(inspect.signature(Sub).parameters) == list(pk.IVON._arguments)
    assert Sub(_params(), 0.1, 10.0).defaults["beta1"] == 0.5
    assert not hasattr(Sub, "beta1") and not hasattr(pk.IVON, "lr")

    def __init__(self, params, lr=0.2):
        pk.IVON.__init__(self, params, lr, 10.0)
    Own = _subclass({"__init__": __init__}, {})
    assert Own(_params()).defaults["lr"] == 0.2
    with pytest.raises(TypeError, match="did you mean 'lr'"):
        Own(_params(), lrr=0.1)


def test_the_database_agrees_with_the_declarations():
    """The tests' database says which classes take ``sample_ahead``, ``state_dtype`` and
    ``outer_dtype``: the declarations decide, the database must follow."""
    for info in infos():
        args = info.cls._arguments
        for flag in ("sample_ahead", "state_dtype", "outer_dtype"):
            assert getattr(info, flag) == (flag in args), (info.name, flag)
