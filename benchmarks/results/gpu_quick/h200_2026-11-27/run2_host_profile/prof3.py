"""cProfile of host_step's loop (no backward) on the GPU host: where the host time goes."""
import cProfile, pstats, io, time, torch
from benchmarks.studies import host_step
dev = torch.device("cuda")
for kind in ("adamw_fused", "ivon", "ivon_pocomo"):
    it, write, calls = host_step._row(kind, dev)
    for _ in range(50): it()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(200): it()
        best = min(best, (time.perf_counter() - t0) / 200 * 1e6)
        torch.cuda.synchronize()
    print(kind, "iteration us (best of 5x200)", round(best, 1))
    if kind == "adamw_fused":
        continue
    pr = cProfile.Profile(); pr.enable()
    for _ in range(200): it()
    pr.disable(); torch.cuda.synchronize()
    for key in ("tottime", "cumulative"):
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats(key).print_stats(45)
        print(s.getvalue()[:12000])
