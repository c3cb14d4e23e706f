"""One stateless rule per algorithm: what an optimizer of the family needs, stated once.

A rule (:class:`~poco_kernels.rules.base.Rule`) says, for one algorithm: which buffers a
bucket holds, where each kind of sample sits (:class:`~poco_kernels._protocol.SampleSpec`),
the inner and refresh updates in the reference maths (:mod:`poco_kernels.reference`), the
kernel records the fused backends launch with (:mod:`poco_kernels.kernels.interface`), and
its flags.  The optimizer classes hold one rule each and keep their constructors, their
hyperparameter validation and their documentation; the backends run the rule.

==============================  ===================================  ==================
optimizer                       rule                                 kernel family
==============================  ===================================  ==================
``IVON``                        :class:`.ivon.IVONRule`              ``FAMILY_IVON``
``IVONPoCo``, ``IVONPoCoMo``    :class:`.ivon.IVONPoCoRule`          ``FAMILY_IVON``
``SVRG``                        :class:`.svrg.SGDRule`               ``FAMILY_SGD``
``VSGDPoCo``                    :class:`.svrg.VSGDRule`              ``FAMILY_SGD``
``SVRGAdamW``                   :class:`.svrg.AdamWRule`             ``FAMILY_ADAMW``
``VONPoCo``                     :class:`.von_poco.VONPoCoRule`       (none: dense)
==============================  ===================================  ==================
"""
from .base import Rule
from .ivon import IVONPoCoRule, IVONRule
from .svrg import AdamWRule, SGDRule, VSGDRule
from .von_poco import VONPoCoRule

__all__ = ["Rule", "IVONRule", "IVONPoCoRule", "SGDRule", "VSGDRule", "AdamWRule",
           "VONPoCoRule"]
