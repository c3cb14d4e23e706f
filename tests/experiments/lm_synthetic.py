"""Constructed results of the LM study, for the tests of its verdicts."""
from poco_kernels.experiments import lm_study as S


def synthetic(sc, loss):
    """Result dicts for every arm of ``sc`` with curves ``loss(arm, seed, step)``."""
    out = []
    for j in S.plan(sc, 1e-3, 1.0):
        s = j.cfg_dict()
        per_step = j.cost() / sc.steps
        curve = [{"step": t, "evals": t * per_step, "wall_s": 0.01 * t,
                  "val_loss": loss(j.arm, j.seed, t)}
                 for t in range(0, sc.steps + 1, sc.eval_every)]
        out.append({"arm": j.arm, "seed": j.seed, "settings": s, "curve": curve,
                    "final_val_loss": curve[-1]["val_loss"], "evals": j.cost(),
                    "train_wall_s": 1.0})
    return out
