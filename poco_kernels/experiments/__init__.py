"""Experiments that reproduce the paper's studies with the package's optimizers.

* :mod:`poco_kernels.experiments.logreg`: Sec. 5.1 (Fig. 2 and 4), L2-regularised logistic
  regression: SGD, SVRG, VSGD, VSGD-PoCo, IVON, IVON-PoCo and VON-PoCo against a
  full-batch L-BFGS reference, with plots and the paper's claims judged
  (``python -m poco_kernels.experiments.logreg --help``); its data sets in
  :mod:`~poco_kernels.experiments.datasets`, the claims in
  :mod:`~poco_kernels.experiments.claims`, the figure in :mod:`~poco_kernels.experiments.plots`.
"""
