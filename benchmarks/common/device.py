"""The device the benchmarks run on: synchronising it, releasing its cached memory, the
memory a benchmark may use, and the description that goes into every CSV row and names
the recorded result files (``device_info``)."""
from __future__ import annotations

import datetime
import gc
import os
import platform
import re
import subprocess

import torch

#: the repository root (this file is benchmarks/common/device.py)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def release(dev):
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def free_bytes(dev):
    """Memory a benchmark may use on ``dev``: CUDA free memory, or the host's available
    memory (``/proc/meminfo``; unknown: 8 GiB)."""
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2 ** 30


def _git_head():
    try:
        return subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    except Exception:
        return None


def device_info(dev):
    """What the rows were measured on.  ``info["device"]`` is the one-line description
    that goes into every CSV row; ``info["slug"]`` names the recorded result files."""
    info = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "torch": torch.__version__, "python": platform.python_version(),
            "threads": torch.get_num_threads(), "git_head": _git_head(),
            "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "")}
    try:
        import triton
        info["triton"] = triton.__version__
    except Exception as exc:
        info["triton"] = f"unavailable: {type(exc).__name__}"
    from poco_kernels.kernels import cpp_status
    if cpp_status() is None:
        from poco_kernels.kernels import cpp_ops
        info["cpp_isa"] = cpp_ops.isa()
    else:
        info["cpp_isa"] = f"unavailable: {cpp_status()}"
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        info.update(name=torch.cuda.get_device_name(dev), capability=list(
            torch.cuda.get_device_capability(dev)), sm_count=p.multi_processor_count,
            total_memory_gib=round(p.total_memory / 2 ** 30, 2),
            l2_cache_mib=round(getattr(p, "L2_cache_size", 0) / 2 ** 20, 1),
            cuda=torch.version.cuda)
        try:
            q = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.mem,clocks.max.sm,"
                 "temperature.gpu,power.draw,power.limit", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20)
            info["nvidia_smi"] = q.stdout.strip() or q.stderr.strip()
        except Exception as exc:
            info["nvidia_smi"] = f"unavailable: {exc}"
        info["device"] = f"{info['name']}, CUDA {info['cuda']}"
        info["slug"] = "gpu_" + re.sub(r"[^A-Za-z0-9]+", "_", info["name"]).strip("_")
        return info
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
        cpu = re.search(r"model name\s*:\s*(.*)", text).group(1).strip()
        info["logical_cpus"] = text.count("processor\t:")
    except (OSError, AttributeError):
        pass
    info["name"] = cpu
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        info["caches"] = "; ".join(line.split(":", 1)[0].strip() + " " +
                                   line.split(":", 1)[1].strip()
                                   for line in lscpu.splitlines() if "cache" in line)
    except (OSError, subprocess.SubprocessError):
        pass
    interp = " (Triton interpreter)" if info["TRITON_INTERPRET"] == "1" else ""
    info["device"] = (f"cpu: {cpu}, {info['threads']} threads, C++ kernels "
                      f"{info['cpp_isa']}{interp}")
    info["slug"] = "cpu_" + re.sub(r"[^A-Za-z0-9]+", "_", cpu).strip("_")
    return info
