"""Data sets of the logistic-regression study.

Bundled with scikit-learn (nothing to download; the default runs on any machine):

=================  =======  ========  =======  ===========================================
name               classes  examples  features  note
=================  =======  ========  =======  ===========================================
``breast_cancer``  2        569       30        the default
``digits``         10       1,797     64        8x8 handwritten digits: a small MNIST
``wine``           3        178       13
``iris``           3        150       4
``digits-binary``  2        1,797     64        digits 0-4 against 5-9
``wine-binary``    2        178       13        class 0 against the rest
``iris-binary``    2        150       4         versicolor against the rest
``synthetic``      2        20,000    50        ``make_classification`` (seeded)
=================  =======  ========  =======  ===========================================

From their standard distribution files on local disk (``--data-dir``; nothing is
downloaded, a missing file is an error that says which file goes where):

* ``mnist``: ``<data-dir>/mnist/`` holds ``train-images-idx3-ubyte``,
  ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``
  (each may be gzipped, ``.gz``): 60,000 / 10,000 images of 28x28, 10 classes;
* ``covertype``: ``<data-dir>/covertype/covtype.data`` (or ``.gz``), the UCI file:
  581,012 rows of 54 features and the cover type 1-7;
* ``cifar10``: ``<data-dir>/cifar10/cifar-10-batches-py/`` (``data_batch_1`` .. ``_5``,
  ``test_batch``; the "python version" of CIFAR-10): 50,000 / 10,000 images of 32x32x3,
  10 classes.

Preprocessing, the same for every set:

* split: the standard train/test split where the data set has one (MNIST, CIFAR-10);
  otherwise stratified, ``test_size`` of the examples held out (``random_state = seed``);
* pixels (MNIST, CIFAR-10) are divided by 255; then every feature is standardised with
  the training set's mean and standard deviation (a constant feature stays 0), or, with
  ``features="scale"``, only divided by its largest training magnitude (pixels then stay
  in [0, 1], uncentred: curvatures differ across features, as in raw image data); a bias
  column of ones is appended;
* labels are 0 .. K-1 (Covertype's 1-7 become 0-6);
* ``max_train`` (optional) keeps a stratified subset of the training examples, for quick
  looks at the large sets.
"""
from __future__ import annotations

import gzip
import os
import pickle
import struct
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

__all__ = ["BUNDLED", "FILES", "DATASETS", "FEATURES", "Data", "MissingDataError", "load",
           "read_idx", "read_mnist", "read_covertype", "read_cifar10"]

BUNDLED = ("breast_cancer", "digits", "wine", "iris", "digits-binary", "wine-binary",
           "iris-binary", "synthetic")
FILES = ("mnist", "covertype", "cifar10")
DATASETS = BUNDLED + FILES


class MissingDataError(FileNotFoundError):
    """A data set's file is not on disk (the message says which file goes where)."""


@dataclass
class Data:
    """A preprocessed data set: float64 features with the bias column last, int64 labels."""
    name: str
    Xtr: np.ndarray
    ytr: np.ndarray
    Xte: np.ndarray
    yte: np.ndarray
    classes: int
    description: str


# ----------------------------------------------------------------------------- files
def _open(path: str):
    """``path`` or ``path.gz``, whichever exists (binary read)."""
    for p in (path, path + ".gz"):
        if os.path.exists(p):
            return gzip.open(p, "rb") if p.endswith(".gz") else open(p, "rb")
    return None


def _missing(name: str, path: str, what: str) -> MissingDataError:
    return MissingDataError(
        f"{name}: {path} (or {os.path.basename(path)}.gz) not found. {what} Nothing is "
        "downloaded: put the files there, or point --data-dir at the folder that holds "
        f"'{os.path.basename(os.path.dirname(path)) or name}/'.")


def read_idx(path: str) -> np.ndarray:
    """An IDX file (the MNIST format: magic 0x00000803 images / 0x00000801 labels,
    big-endian dimensions, unsigned bytes), ``path`` or ``path.gz``."""
    fh = _open(path)
    if fh is None:
        raise FileNotFoundError(path)
    with fh:
        data = fh.read()
    zero, dtype, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype != 0x08:
        raise ValueError(f"{path}: not an IDX file of unsigned bytes (magic {data[:4].hex()})")
    dims = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(dims)):
        raise ValueError(f"{path}: {body.size} bytes of data for dimensions {dims}")
    return body.reshape(dims)


MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
               "t10k-labels-idx1-ubyte")


def read_mnist(folder: str) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train images (n, 784) uint8, train labels, test images, test labels)."""
    out = []
    for f in MNIST_FILES:
        path = os.path.join(folder, f)
        try:
            out.append(read_idx(path))
        except FileNotFoundError:
            raise _missing("mnist", path, "MNIST needs its four IDX files: "
                           + ", ".join(MNIST_FILES) + ".") from None
    Xtr, ytr, Xte, yte = out
    return Xtr.reshape(len(Xtr), -1), ytr, Xte.reshape(len(Xte), -1), yte


def read_covertype(folder: str) -> Tuple[np.ndarray, np.ndarray]:
    """(features (n, 54) float64, cover type 1-7) from UCI's ``covtype.data``."""
    path = os.path.join(folder, "covtype.data")
    fh = _open(path)
    if fh is None:
        raise _missing("covertype", path, "Covertype needs UCI's covtype.data (54 features "
                       "and the cover type per line, comma-separated).")
    with fh:
        arr = np.loadtxt(fh, delimiter=",", dtype=np.float64, ndmin=2)
    if arr.shape[1] != 55:
        raise ValueError(f"{path}: {arr.shape[1]} columns, expected 55 (54 features + label)")
    return arr[:, :54], arr[:, 54].astype(np.int64)


def read_cifar10(folder: str) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train images (50000, 3072) uint8, labels, test images, labels) from the python
    version's pickled batches (``data_batch_1`` .. ``_5`` and ``test_batch``)."""
    base = os.path.join(folder, "cifar-10-batches-py")
    if not os.path.isdir(base) and os.path.exists(os.path.join(folder, "test_batch")):
        base = folder                    # the batches directly in the folder
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    parts = []
    for n in names:
        path = os.path.join(base, n)
        if not os.path.exists(path):
            raise _missing("cifar10", path, "CIFAR-10 needs the 'python version' batches "
                           "(data_batch_1 .. data_batch_5, test_batch) in cifar-10-batches-py/.")
        with open(path, "rb") as fh:
            d = pickle.load(fh, encoding="bytes")
        parts.append((np.asarray(d[b"data"], dtype=np.uint8),
                      np.asarray(d[b"labels"], dtype=np.int64)))
    Xtr = np.concatenate([p[0] for p in parts[:5]])
    ytr = np.concatenate([p[1] for p in parts[:5]])
    return Xtr, ytr, parts[5][0], parts[5][1]


# ----------------------------------------------------------------------------- loading
def _bundled(name: str, seed: int, n_synthetic: int) -> Tuple[np.ndarray, np.ndarray]:
    import sklearn.datasets as skd
    loader = {"breast_cancer": skd.load_breast_cancer, "digits": skd.load_digits,
              "wine": skd.load_wine, "iris": skd.load_iris}
    base = name.replace("-binary", "")
    if base in loader:
        X, y = loader[base](return_X_y=True)
    elif name == "synthetic":
        X, y = skd.make_classification(n_samples=n_synthetic, n_features=50, n_informative=20,
                                       n_redundant=10, flip_y=0.05, class_sep=0.8,
                                       random_state=seed)
    else:
        raise ValueError(f"unknown dataset {name!r} (expected one of {DATASETS})")
    if name == "digits-binary":            # digits 0-4 against 5-9
        y = (y >= 5)
    elif name == "wine-binary":            # class 0 against the rest
        y = (y == 0)
    elif name == "iris-binary":            # versicolor against the rest (not separable)
        y = (y == 1)
    return np.asarray(X, dtype=np.float64), np.asarray(y, dtype=np.int64)


def _subset(X, y, n: int, seed: int):
    from sklearn.model_selection import train_test_split
    keep, _, ykeep, _ = train_test_split(X, y, train_size=n, random_state=seed, stratify=y)
    return keep, ykeep


FEATURES = ("standardize", "scale")


def load(name: str, *, seed: int = 0, test_size: float = 0.2, data_dir: str = "data",
         n_synthetic: int = 20_000, max_train: Optional[int] = None,
         features: str = "standardize") -> Data:
    """Load and preprocess a data set (see the module docstring)."""
    from sklearn.model_selection import train_test_split
    if name in BUNDLED:
        X, y = _bundled(name, seed, n_synthetic)
        Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=test_size, random_state=seed,
                                              stratify=y)
        source = "scikit-learn (bundled)"
    elif name == "mnist":
        Xtr, ytr, Xte, yte = read_mnist(os.path.join(data_dir, "mnist"))
        Xtr, Xte = Xtr / 255.0, Xte / 255.0
        source = f"MNIST IDX files in {os.path.join(data_dir, 'mnist')} (standard split)"
    elif name == "covertype":
        X, y = read_covertype(os.path.join(data_dir, "covertype"))
        Xtr, Xte, ytr, yte = train_test_split(X, y - 1, test_size=test_size,
                                              random_state=seed, stratify=y)
        source = f"UCI covtype.data in {os.path.join(data_dir, 'covertype')}"
    elif name == "cifar10":
        Xtr, ytr, Xte, yte = read_cifar10(os.path.join(data_dir, "cifar10"))
        Xtr, Xte = Xtr / 255.0, Xte / 255.0
        source = (f"CIFAR-10 python batches in {os.path.join(data_dir, 'cifar10')} "
                  "(standard split)")
    else:
        raise ValueError(f"unknown dataset {name!r} (expected one of {', '.join(DATASETS)})")
    Xtr, Xte = np.asarray(Xtr, dtype=np.float64), np.asarray(Xte, dtype=np.float64)
    ytr, yte = np.asarray(ytr, dtype=np.int64), np.asarray(yte, dtype=np.int64)
    if max_train is not None and max_train < len(ytr):
        Xtr, ytr = _subset(Xtr, ytr, max_train, seed)
    if features == "standardize":
        mu, sd = Xtr.mean(0), Xtr.std(0)
        sd[sd == 0] = 1.0
        how = "features standardised (train statistics)"
    elif features == "scale":
        mu, sd = np.zeros(Xtr.shape[1]), np.abs(Xtr).max(0)
        sd[sd == 0] = 1.0
        how = "features divided by their largest train magnitude (not centred)"
    else:
        raise ValueError(f"features must be one of {FEATURES}, got {features!r}")

    def prep(A):
        return np.hstack([(A - mu) / sd, np.ones((A.shape[0], 1))])
    classes = int(max(ytr.max(), yte.max()) + 1)
    desc = (f"{name}: {len(ytr)} train / {len(yte)} test examples, {Xtr.shape[1]} features "
            f"+ bias, {classes} classes; {source}; {how}")
    return Data(name, np.ascontiguousarray(prep(Xtr)), ytr, np.ascontiguousarray(prep(Xte)),
                yte, classes, desc)
