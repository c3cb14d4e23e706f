"""Experiments that reproduce the paper's studies with the package's optimizers.

* :mod:`poco_kernels.experiments.logreg`: Sec. 5.1 (Fig. 2 and 4), L2-regularised logistic
  regression: SGD, SVRG, VSGD, VSGD-PoCo, IVON, IVON-PoCo and VON-PoCo against a
  full-batch L-BFGS optimum, with plots and the paper's claims judged
  (``python -m poco_kernels.experiments.logreg --help``); its data sets in
  :mod:`~poco_kernels.experiments.datasets`, the claims in
  :mod:`~poco_kernels.experiments.claims`, the figure in :mod:`~poco_kernels.experiments.plots`;
  the code by role in ``logreg_config``, ``logreg_problem``, ``logreg_methods``,
  ``logreg_loop`` and ``logreg_report``.
* :mod:`poco_kernels.experiments.pretrain`: Sec. 5.2 and the continual-pretraining
  appendix, GPT pretraining with AdamW, IVON or IVON-PoCoMo, single process, DDP or FSDP2
  (``python -m poco_kernels.experiments.pretrain --help``); the model in
  :mod:`~poco_kernels.experiments.gpt`, the data in :mod:`~poco_kernels.experiments.lm_data`,
  starting from saved IVON states in :mod:`~poco_kernels.experiments.continual`; the code
  by role in ``pretrain_config``, ``pretrain_setup``, ``pretrain_loop``,
  ``pretrain_checkpoint`` and ``pretrain_report``.
* :mod:`poco_kernels.experiments.lm_study`: the paper's language-model claims (Sec. 5.2,
  App. 'Ablations') rerun with that loop at CPU scale over seeds, with lr sweeps, alpha,
  schedule and refresh-interval ablations, plots and a verdict per claim
  (``python -m poco_kernels.experiments.lm_study --quick``); the verdicts in
  :mod:`~poco_kernels.experiments.lm_study_claims`, the figures in
  :mod:`~poco_kernels.experiments.lm_study_plots`.
"""
