"""poco_kernels: the optimizers of "SVRG and Beyond via Posterior Correction" (ICML 2026).

SVRG / alpha-SVRG (:class:`SVRG`, :class:`SVRGAdamW`), :class:`VSGDPoCo`, :class:`IVON`,
:class:`IVONPoCo` (IVON-PoCo and, with outer momentum, IVON-PoCoMo;
:class:`IVONPoCoMo` has the paper's momentum defaults) and :class:`VONPoCo`,
as ``torch.optim.Optimizer`` subclasses over flat state buffers.  The maths is stated once
in :mod:`poco_kernels.reference`.
"""
from .ivon import IVON, IVONPoCo, IVONPoCoMo
from .svrg import SVRG, SVRGAdamW, VSGDPoCo
from .von_poco import VONPoCo
from . import amp  # noqa: E402,F401  (poco_kernels.amp.GradScaler: float16 loss scaling)

__all__ = ["IVON", "IVONPoCo", "IVONPoCoMo", "SVRG", "SVRGAdamW", "VSGDPoCo", "VONPoCo"]
__version__ = "0.1.0"
