"""Loaders of the logistic-regression study, on small files the tests write in the standard
distribution formats (IDX for MNIST, UCI's covtype.data, CIFAR-10's python pickles)."""
import gzip
import os
import pickle
import struct

import numpy as np
import pytest

pytest.importorskip("sklearn")

from poco_kernels.experiments import datasets as D  # noqa: E402
from poco_kernels.experiments import logreg as L  # noqa: E402


def _idx(path, arr, gz):
    header = struct.pack(">HBB", 0, 0x08, arr.ndim) + struct.pack(">" + "I" * arr.ndim,
                                                                 *arr.shape)
    data = header + arr.astype(np.uint8).tobytes()
    if gz:
        with gzip.open(path + ".gz", "wb") as f:
            f.write(data)
    else:
        with open(path, "wb") as f:
            f.write(data)


def _mnist(root, n_train=40, n_test=20, gz=True):
    rng = np.random.default_rng(0)
    folder = os.path.join(root, "mnist")
    os.makedirs(folder)
    imgs = {n: rng.integers(0, 256, size=(k, 28, 28)) for n, k in (("train", n_train),
                                                                    ("t10k", n_test))}
    labs = {n: np.arange(k) % 10 for n, k in (("train", n_train), ("t10k", n_test))}
    for n in ("train", "t10k"):
        _idx(os.path.join(folder, f"{n}-images-idx3-ubyte"), imgs[n], gz)
        _idx(os.path.join(folder, f"{n}-labels-idx1-ubyte"), labs[n], not gz)  # mixed
    return imgs, labs


def _covertype(root, n=84):
    rng = np.random.default_rng(1)
    folder = os.path.join(root, "covertype")
    os.makedirs(folder)
    X = np.hstack([rng.normal(2000, 300, (n, 10)).round(), rng.integers(0, 2, (n, 44))])
    y = 1 + np.arange(n) % 7
    lines = "\n".join(",".join(str(int(v)) for v in row) + f",{c}" for row, c in zip(X, y))
    with gzip.open(os.path.join(folder, "covtype.data.gz"), "wt") as f:
        f.write(lines + "\n")
    return X, y


def _cifar(root, per_batch=6):
    rng = np.random.default_rng(2)
    folder = os.path.join(root, "cifar10", "cifar-10-batches-py")
    os.makedirs(folder)
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        d = {b"data": rng.integers(0, 256, (per_batch, 3072)).astype(np.uint8),
             b"labels": list(rng.integers(0, 10, per_batch))}
        batches[name] = d
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump(d, f)
    return batches


def _standardised(data):
    """Training features have mean 0 and std 1 (or are constant 0); bias column last."""
    X = data.Xtr[:, :-1]
    assert np.allclose(data.Xtr[:, -1], 1.0) and np.allclose(data.Xte[:, -1], 1.0)
    assert np.allclose(X.mean(0), 0.0, atol=1e-9)
    sd = X.std(0)
    assert np.all(np.isclose(sd, 1.0) | np.isclose(sd, 0.0))


@pytest.mark.parametrize("gz", [True, False])
def test_mnist_from_idx_files(tmp_path, gz):
    imgs, labs = _mnist(str(tmp_path), gz=gz)
    data = D.load("mnist", data_dir=str(tmp_path))
    assert data.classes == 10 and data.Xtr.shape == (40, 785) and data.Xte.shape == (20, 785)
    assert np.array_equal(data.ytr, labs["train"]) and np.array_equal(data.yte, labs["t10k"])
    _standardised(data)
    # pixels / 255, then standardised with the training statistics
    raw = imgs["train"].reshape(40, -1) / 255.0
    mu, sd = raw.mean(0), raw.std(0)
    assert np.allclose(data.Xtr[:, 5], (raw[:, 5] - mu[5]) / sd[5])
    raw_te = imgs["t10k"].reshape(20, -1) / 255.0
    assert np.allclose(data.Xte[:, 7], (raw_te[:, 7] - mu[7]) / sd[7])


def test_covertype_from_the_uci_file(tmp_path):
    X, y = _covertype(str(tmp_path))
    data = D.load("covertype", data_dir=str(tmp_path), seed=3, test_size=0.25)
    assert data.classes == 7 and data.Xtr.shape[1] == 55
    assert len(data.ytr) + len(data.yte) == len(y) and len(data.yte) == 21
    assert set(np.unique(data.ytr)) == set(range(7))           # labels 1-7 -> 0-6, stratified
    _standardised(data)


def test_cifar10_from_the_python_batches(tmp_path):
    batches = _cifar(str(tmp_path))
    data = D.load("cifar10", data_dir=str(tmp_path))
    assert data.Xtr.shape == (30, 3073) and data.Xte.shape == (6, 3073)
    assert list(data.ytr[:6]) == list(batches["data_batch_1"][b"labels"])
    assert list(data.yte) == list(batches["test_batch"][b"labels"])
    _standardised(data)


@pytest.mark.parametrize("name, missing", [("mnist", "train-images-idx3-ubyte"),
                                           ("covertype", "covtype.data"),
                                           ("cifar10", "data_batch_1")])
def test_a_missing_file_says_which_file_goes_where(tmp_path, name, missing):
    with pytest.raises(D.MissingDataError) as e:
        D.load(name, data_dir=str(tmp_path))
    msg = str(e.value)
    assert missing in msg and str(tmp_path) in msg and "Nothing is downloaded" in msg
    # the command line says it too, and exits with 2
    assert L.main(["--dataset", name, "--data-dir", str(tmp_path), "--steps", "10",
                   "--out-dir", ""]) == 2


def test_idx_reader_rejects_other_files(tmp_path):
    p = tmp_path / "x"
    p.write_bytes(b"\x00\x00\x0d\x01" + b"\x00\x00\x00\x04" + b"\x00" * 16)   # float32 IDX
    with pytest.raises(ValueError, match="unsigned bytes"):
        D.read_idx(str(p))


def test_bundled_sets_and_a_training_subset():
    data = D.load("digits", seed=0)
    assert data.classes == 10 and data.Xtr.shape[1] == 65
    assert len(data.ytr) + len(data.yte) == 1797
    sub = D.load("digits", seed=0, max_train=300)
    assert len(sub.ytr) == 300 and set(np.unique(sub.ytr)) == set(range(10))
    assert D.load("breast_cancer").classes == 2
    with pytest.raises(ValueError, match="unknown dataset"):
        D.load("imagenet")
