"""Experiments that reproduce the paper's studies with the package's optimizers.

* :mod:`poco_kernels.experiments.logreg`: Sec. 5.1, L2-regularised logistic regression:
  SGD, SVRG, VSGD, VSGD-PoCo, IVON and IVON-PoCo against a full-batch L-BFGS reference
  (``python -m poco_kernels.experiments.logreg --help``).
"""
