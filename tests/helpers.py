"""Small problems and drivers shared by the tests."""
import torch


def available_backends():
    """The backends that run here: the torch backend always; the C++ kernels when the
    extension is built (CI builds it: tests/kernels/test_cpp_backend.py fails if it is not); the
    Triton kernels through the interpreter (TRITON_INTERPRET=1, set by conftest)."""
    from poco_kernels.kernels import cpp_status, triton_status
    out = ["torch"]
    if cpp_status() is None:
        out.append("cpp")
    if triton_status(torch.device("cpu")) is None:
        out.append("triton")
    return out


FUSED_BACKENDS = [b for b in available_backends() if b != "torch"]


def mlp(seed=3, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(9, 13), torch.nn.Tanh(),
                               torch.nn.Linear(13, 3)).to(dtype)


class Problem:
    """A 3-class classification problem on 96 random points; batches drawn from a
    generator with a fixed seed so every run sees the same mini-batches."""

    def __init__(self, seed=0, n=96, dtype=torch.float32):
        g = torch.Generator().manual_seed(seed)
        self.X = torch.randn(n, 9, generator=g).to(dtype)
        self.Y = torch.randint(0, 3, (n,), generator=g)
        self.n = n

    def loss(self, model, idx):
        out = model(self.X[idx].to(next(model.parameters()).dtype))
        return torch.nn.functional.cross_entropy(out.float(), self.Y[idx])

    def closure(self, opt, model, idx):
        def c():
            opt.zero_grad()
            loss = self.loss(model, idx)
            loss.backward()
            return loss
        return c

    def batches(self, steps, size=8, seed=1):
        g = torch.Generator().manual_seed(seed)
        return [torch.randint(0, self.n, (size,), generator=g) for _ in range(steps)]

    def chunks(self, k=4):
        return list(torch.arange(self.n).chunk(k))


def run(opt, model, prob, steps, *, refresh_every=None, warmup=0, start=0, batches=None,
        chunks=None):
    """Inner steps ``start..steps-1`` with refreshes at ``warmup + k * refresh_every``."""
    batches = batches if batches is not None else prob.batches(steps)
    chunks = chunks if chunks is not None else prob.chunks()
    losses = []
    for t in range(start, steps):
        if refresh_every and t >= warmup and (t - warmup) % refresh_every == 0:
            opt.refresh([prob.closure(opt, model, c) for c in chunks])
        losses.append(float(opt.step(prob.closure(opt, model, batches[t])).detach()))
    return losses


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]
