"""Token data for the GPT pretraining run (:mod:`poco_kernels.experiments.pretrain`).

Two sources, one interface (:class:`TokenData`, a train and a val split of token ids):

* ``"stdlib"`` (the default): the source text of Python's own standard library, found
  with :mod:`sysconfig` on any machine that runs Python, as byte-level tokens (vocabulary
  256).  Files are read in sorted order, test suites and ``site-packages`` left out, each
  followed by a NUL byte; every 20th file (by sorted path) is the validation split.
  About 12 MB of tokens with CPython 3.11.
* a directory holding ``train.bin`` and ``val.bin``: flat ``uint16`` token ids, as
  nanoGPT's ``prepare.py`` writes them (GPT-2's BPE: vocabulary 50257).  They are memory
  mapped, not read.

Batches are addressed, not streamed: global mini-batch ``k`` of a split is ``B``
windows of ``T + 1`` tokens at offsets drawn from a generator seeded with
``(data_seed, split, k)``.  So the data position of a run is one integer (how many
mini-batches it has drawn), a resumed run draws exactly the batches the uninterrupted one
would have, and rank ``r`` of ``W`` takes rows ``[r B / W, (r + 1) B / W)`` of the same
global batch: a data-parallel run sees the single-process run's global batches whatever
``W`` is.
"""
from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np
import torch

__all__ = ["TokenData", "load_tokens", "stdlib_files", "SPLITS"]

SPLITS = {"train": 0, "val": 1}
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
VAL_EVERY = 20


def stdlib_files(root: Optional[str] = None) -> List[Path]:
    """The standard library's ``.py`` files, sorted by relative path (tests left out)."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise FileNotFoundError(f"Python's standard library was not found at {base}")
    out = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for f in sorted(filenames):
            if f.endswith(".py"):
                out.append(Path(dirpath) / f)
    out.sort(key=lambda p: p.relative_to(base).as_posix())
    if not out:
        raise FileNotFoundError(f"no .py files under {base}")
    return out


@dataclass
class TokenData:
    """Token ids of a train and a val split, with the vocabulary size and a fingerprint
    (checked when a run resumes, so it does not silently continue on other data)."""
    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    name: str
    fingerprint: str

    def split(self, split: str) -> np.ndarray:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {tuple(SPLITS)}, got {split!r}")
        return self.train if split == "train" else self.val

    def check_seq_len(self, seq_len: int) -> None:
        for s in SPLITS:
            n = len(self.split(s))
            if n < seq_len + 2:
                raise ValueError(f"the {s} split of {self.name} has {n} tokens, fewer than "
                                 f"seq_len + 2 = {seq_len + 2}")

    def offsets(self, split: str, index: int, rows: int, seq_len: int, data_seed: int
                ) -> np.ndarray:
        """Start offsets of global mini-batch ``index`` (``rows`` windows)."""
        n = len(self.split(split))
        rng = np.random.default_rng([int(data_seed), SPLITS[split], int(index)])
        return rng.integers(0, n - seq_len - 1, size=rows)

    def batch(self, split: str, index: int, rows: int, seq_len: int, data_seed: int,
              lo: int = 0, hi: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Rows ``[lo, hi)`` of global mini-batch ``index``: inputs and next-token targets,
        int64 tensors of shape ``(hi - lo, seq_len)``."""
        toks = self.split(split)
        offs = self.offsets(split, index, rows, seq_len, data_seed)[lo:hi]
        win = np.stack([np.asarray(toks[o:o + seq_len + 1], dtype=np.int64) for o in offs])
        t = torch.from_numpy(win)
        return t[:, :-1], t[:, 1:]


def _fingerprint(*arrays: np.ndarray) -> str:
    h = hashlib.sha1()
    for a in arrays:
        h.update(str((len(a), a.dtype.str)).encode())
        step = max(1, len(a) // 4096)              # a sparse sample: memmaps stay cheap
        h.update(np.ascontiguousarray(a[::step]).tobytes())
    return h.hexdigest()[:16]


def _load_stdlib(root: Optional[str]) -> TokenData:
    files = stdlib_files(root)
    train, val = [], []
    for i, f in enumerate(files):
        (val if i % VAL_EVERY == 0 else train).append(f.read_bytes() + b"\0")
    tr = np.frombuffer(b"".join(train), dtype=np.uint8)
    va = np.frombuffer(b"".join(val), dtype=np.uint8)
    return TokenData(tr, va, 256, f"stdlib:{Path(files[0]).parent}", _fingerprint(tr, va))


def _load_bin_dir(path: Path) -> TokenData:
    arrays = []
    for s in ("train", "val"):
        f = path / f"{s}.bin"
        if not f.is_file():
            raise FileNotFoundError(
                f"{f} not found: a token directory holds train.bin and val.bin (flat uint16 "
                "token ids, as nanoGPT's prepare.py writes them)")
        if f.stat().st_size % 2 or f.stat().st_size == 0:
            raise ValueError(f"{f} is not a non-empty flat uint16 file "
                             f"({f.stat().st_size} bytes)")
        arrays.append(np.memmap(f, dtype=np.uint16, mode="r"))
    # the vocabulary: GPT-2's unless the file says otherwise (meta.pkl is nanoGPT's)
    vocab = 50257
    meta = path / "meta.pkl"
    if meta.is_file():
        import pickle
        with open(meta, "rb") as fh:
            vocab = int(pickle.load(fh).get("vocab_size", vocab))
    return TokenData(arrays[0], arrays[1], vocab, f"bin:{path}", _fingerprint(*arrays))


def load_tokens(source: str = "stdlib", *, stdlib_root: Optional[str] = None) -> TokenData:
    """``"stdlib"`` or a directory with ``train.bin``/``val.bin`` (module docstring)."""
    if source == "stdlib":
        return _load_stdlib(stdlib_root)
    p = Path(source)
    if not p.is_dir():
        raise FileNotFoundError(f"--data {source!r}: not 'stdlib' and not a directory holding "
                                "train.bin and val.bin")
    return _load_bin_dir(p)
