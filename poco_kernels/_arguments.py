"""Constructor arguments written once: each optimizer declares its arguments as annotated
class attributes, and the constructor, its signature and the docstring's argument list
follow from the declarations.

::

    class IVON(PosteriorOptimizer):
        lr: float = hyperparameter(doc="learning rate ...")              # required
        hess_init: float = hyperparameter(default=1.0, doc="...")
        sample_ahead: bool = option(default=False, doc="...")            # keyword-only

    class IVONPoCoMo(IVONPoCo):
        rho1: float = 0.6                # an inherited argument with another default

* :func:`hyperparameter`: an argument per parameter group (a key of ``defaults`` and of
  every ``param_groups`` entry);
* :func:`option`: a keyword-only argument of the optimizer as a whole (``seed``, ...);
* :func:`argument`: a positional argument that is neither (``params``).

A subclass inherits its base's arguments in their order and appends its own, as a
dataclass does (a redeclared argument keeps its place).  The generated ``__init__`` has the
real signature (``help()``, ``inspect.signature``, IPython's completion) and hands the
values to ``self._initialise(params, defaults, **options)``; a class that writes its own
``__init__`` keeps it.  Static tools read the same declarations through
:func:`typing.dataclass_transform` (pyright/Pylance show the exact signature).  Every other
annotated class attribute of the package's optimizers must be a ``ClassVar``: the static
tools would take it for an argument, so a class that has one is refused at import.

``{arguments}`` in a class docstring becomes the list of its arguments with their defaults.
"""
from __future__ import annotations

import inspect
import re
import sys
import textwrap
from typing import Any, Callable, ClassVar, Dict, Optional

if sys.version_info >= (3, 11):
    from typing import dataclass_transform
else:                                     # (Python 3.10: torch requires typing_extensions)
    from typing_extensions import dataclass_transform

__all__ = ["Argument", "REQUIRED", "argument", "hyperparameter", "option", "DeclaredArguments"]


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


#: the default of an argument that has none
REQUIRED: Any = _Required()

#: where an argument goes: the constructor's positional ``params``, a parameter group's
#: hyperparameter, an optimizer-wide keyword-only option
KINDS = ("argument", "hyperparameter", "option")


class Argument:
    """One declared constructor argument."""

    __slots__ = ("name", "kind", "default", "doc", "annotation", "convert")

    def __init__(self, kind: str, default: Any, doc: str,
                 convert: Optional[Callable[[Any], Any]] = None, name: str = "",
                 annotation: Any = None):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if not doc or not doc.strip():
            raise ValueError("every argument is documented: doc is empty")
        self.name, self.kind, self.default, self.doc = name, kind, default, doc
        self.annotation, self.convert = annotation, convert

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    @property
    def keyword_only(self) -> bool:
        return self.kind == "option"

    def replace(self, **changes) -> "Argument":
        fields = {k: getattr(self, k) for k in self.__slots__}
        fields.update(changes)
        return Argument(**fields)

    def __repr__(self) -> str:
        return f"Argument({self.name!r}, {self.kind}, default={self.default!r})"


# The field specifiers.  Their parameters ``default`` and ``kw_only`` are the ones
# dataclass_transform defines: static tools read them from the call.
def argument(*, default: Any = REQUIRED, doc: str) -> Any:
    """A positional constructor argument that is not a hyperparameter (``params``)."""
    return Argument("argument", default, doc)


def hyperparameter(*, default: Any = REQUIRED, doc: str,
                   convert: Optional[Callable[[Any], Any]] = None) -> Any:
    """A per-group hyperparameter: positional-or-keyword, a key of ``defaults``.
    ``convert`` normalises the constructor's value (``betas`` -> a tuple)."""
    return Argument("hyperparameter", default, doc, convert)


def option(*, default: Any, doc: str, kw_only: bool = True) -> Any:
    """A keyword-only argument of the optimizer as a whole (not per group)."""
    if kw_only is not True:
        raise ValueError("an option is keyword-only")
    return Argument("option", default, doc)


def _annotation(cls, text: Any) -> Any:
    """A string annotation (``from __future__ import annotations``) evaluated in the class's
    module, for ``help()``; left a string where it cannot be."""
    if not isinstance(text, str):
        return text
    try:
        return eval(text, vars(sys.modules[cls.__module__]), dict(vars(cls)))
    except Exception:
        return text


def _collect(cls) -> Dict[str, Argument]:
    """The class's arguments: its bases', then its own declarations, in signature order."""
    args: Dict[str, Argument] = {}
    for base in reversed(cls.__bases__):
        args.update(getattr(base, "_arguments", {}))
    for name, ann in inspect.get_annotations(cls).items():
        value = cls.__dict__.get(name, REQUIRED)
        if isinstance(value, Argument):
            old = args.get(name)
            if old is not None and old.kind != value.kind:
                raise TypeError(f"{cls.__name__}.{name}: declared as {value.kind}, "
                                f"inherited as {old.kind}")
            args[name] = value.replace(name=name, annotation=_annotation(cls, ann))
        elif name in args and name in cls.__dict__:          # another default
            args[name] = args[name].replace(default=value)
        elif "ClassVar" in str(ann) or not cls.__module__.startswith("poco_kernels."):
            continue            # (a user's subclass may annotate what it likes)
        else:
            raise TypeError(
                f"{cls.__name__}.{name}: an annotated class attribute of an optimizer is "
                "a constructor argument (hyperparameter(), option(), argument()) or a "
                "ClassVar; static tools would take this one for an argument")
        if name in cls.__dict__:
            delattr(cls, name)
    # signature order: the positional ones as declared, then the keyword-only ones
    return {n: a for pass_ in (False, True) for n, a in args.items()
            if a.keyword_only is pass_}


def _make_init(cls, args: Dict[str, Argument]) -> Callable:
    """``__init__`` with the declared signature, built from source as dataclasses does
    (so ``inspect.signature`` and tracebacks see plain parameters)."""
    positional = [a for a in args.values() if not a.keyword_only]
    keyword = [a for a in args.values() if a.keyword_only]
    first_default = next((a.name for a in positional if not a.required), None)
    if first_default is not None:
        tail = positional[[a.name for a in positional].index(first_default):]
        wrong = [a.name for a in tail if a.required]
        if wrong:
            raise TypeError(f"{cls.__name__}: required argument(s) {wrong} after "
                            f"{first_default!r}, which has a default")
    ns: Dict[str, Any] = {"_convert": {a.name: a.convert for a in args.values() if a.convert}}

    def param(a: Argument) -> str:
        if a.required:
            return a.name
        ns[f"_default_{a.name}"] = a.default
        return f"{a.name}=_default_{a.name}"

    sig = ["self", *map(param, positional)] + (["*", *map(param, keyword)] if keyword else [])
    head = [a.name for a in positional if a.kind == "argument"]
    group = [a.name for a in positional if a.kind == "hyperparameter"]
    body = [f"defaults = {{{', '.join(f'{n!r}: {n}' for n in group)}}}",
            "for _k, _f in _convert.items():",
            "    defaults[_k] = _f(defaults[_k])",
            f"self._initialise({', '.join(head)}, defaults"
            + "".join(f", {a.name}={a.name}" for a in keyword) + ")"]
    src = f"def __init__({', '.join(sig)}):\n" + "".join(f"    {line}\n" for line in body)
    exec(src, ns)
    init = ns["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__annotations__ = {a.name: a.annotation for a in args.values() if a.annotation}
    init.__doc__ = f"Build the optimizer: see :class:`{cls.__name__}` for the arguments."
    return init


_WIDTH = 92
_LITERAL = re.compile(r"``.*?``")


def _fill(text: str, first: str, rest: str) -> str:
    """``textwrap.fill`` that never breaks inside a ``literal``."""
    glued = _LITERAL.sub(lambda m: m.group(0).replace(" ", "\0"), text)
    return textwrap.fill(glued, _WIDTH, initial_indent=first, subsequent_indent=rest,
                         break_on_hyphens=False, break_long_words=False).replace("\0", " ")


def _format(a: Argument) -> str:
    """One argument's entry in a docstring: its paragraphs refilled, ``- `` items kept."""
    default = "required" if a.required else f"default ``{a.default!r}``"
    text = textwrap.dedent(a.doc).strip()
    if "\n" in text:        # (dedent: the first line follows the quotes, not indented)
        head, rest = text.split("\n", 1)
        text = head + "\n" + textwrap.dedent(rest)
    out = []
    for i, block in enumerate(text.split("\n\n")):
        items = [block] if not block.lstrip().startswith("- ") else \
            ["- " + it for it in block.strip()[2:].split("\n- ")]
        for item in items:
            words = " ".join(item.split())
            if i == 0:
                out.append(_fill(f"* ``{a.name}`` ({default}): {words}", "    ", "      "))
            else:
                hang = "  " if words.startswith("- ") else ""
                out.append(_fill(words, "      ", "      " + hang))
        if i == 0 and text.count("\n\n"):
            out.append("")
    return "\n".join(out)


def arguments_doc(args: Dict[str, Argument]) -> str:
    """The docstring's argument list: positional ones, then per-group hyperparameters, then
    the keyword-only options."""
    parts = []
    for kind, title in (("argument", None),
                        ("hyperparameter", "Per parameter group (the defaults of each "
                                           "``param_groups`` entry):"),
                        ("option", "Keyword-only, for the optimizer as a whole:")):
        entries = [_format(a) for a in args.values() if a.kind == kind]
        if entries:
            parts.append(("    " + title + "\n\n" if title else "") + "\n".join(entries))
    return "\n\n".join(parts).lstrip()


@dataclass_transform(field_specifiers=(argument, hyperparameter, option))
class DeclaredArguments:
    """Root of the classes whose constructor follows from declared arguments."""

    #: the class's arguments by name, in signature order (inherited ones first)
    _arguments: ClassVar[Dict[str, Argument]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._arguments = _collect(cls)
        if "__init__" not in cls.__dict__ and cls._arguments:
            cls.__init__ = _make_init(cls, cls._arguments)
        if cls.__doc__ and "{arguments}" in cls.__doc__:
            cls.__doc__ = cls.__doc__.replace("{arguments}", arguments_doc(cls._arguments))
