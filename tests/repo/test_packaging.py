"""The README holds exactly two set-up-and-run commands, and CI runs the test one."""
import os
import re
import sys
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _readme_commands():
    text = open(os.path.join(ROOT, "README.md")).read()
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", text, flags=re.S)
    return [b.strip() for b in blocks if "python3 -m venv" in b]


def test_readme_has_two_commands_and_ci_runs_the_test_one():
    cmds = _readme_commands()
    assert len(cmds) == 2, cmds
    main, test = cmds
    assert "poco_kernels.experiments.logreg" in main
    assert "pytest" in test
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert test in ci.splitlines()


def test_install_pins_the_cpu_torch_before_the_package():
    """torch and ninja are there before the package, whose install builds the C++
    extension against that torch (no build isolation)."""
    for cmd in _readme_commands():
        assert cmd.index("torch==2.13.0") < cmd.index("-e ")
        assert cmd.index("ninja") < cmd.index("-e ")
        assert "--no-build-isolation" in cmd


def _setup_dist(monkeypatch, build_temp):
    """setup.py's distribution, its build_temp set as an install would set it (an
    editable install: a fresh temporary directory), without building anything."""
    pytest.importorskip("torch.utils.cpp_extension")
    import setuptools  # noqa: F401  (first: distutils is then setuptools' own)
    from distutils.core import run_setup
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("POCO_KERNELS_NO_EXTENSION", raising=False)
    dist = run_setup(os.path.join(ROOT, "setup.py"), stop_after="init")
    dist.get_command_obj("build").build_temp = str(build_temp)
    cmd = dist.get_command_obj("build_ext")
    cmd.ensure_finalized()
    return cmd


def test_a_reinstall_keeps_the_object_files(tmp_path, monkeypatch):
    """An editable install builds in a new temporary directory each time; the object
    files go under build/ instead, so ninja recompiles only what changed."""
    cmd = _setup_dist(monkeypatch, tmp_path / "pip-editable-build-temp")
    kept = os.path.join(ROOT, "build",
                        f"temp.{sysconfig.get_platform()}-{sys.implementation.cache_tag}")
    assert cmd.build_temp == kept
    inside = os.path.join(ROOT, "build", "temp.elsewhere")     # an install's own choice
    assert _setup_dist(monkeypatch, inside).build_temp == inside


def test_the_built_library_is_replaced_only_when_it_changed(tmp_path, monkeypatch):
    """Copying the built library into the package: nothing when the bytes are the same;
    else a new file renamed over the old (a process that loaded the old one keeps it)."""
    cmd = _setup_dist(monkeypatch, tmp_path / "t")
    built, inplace = tmp_path / "built.so", tmp_path / "inplace.so"
    built.write_bytes(b"v1")
    assert cmd.copy_file(str(built), str(inplace))[1] and inplace.read_bytes() == b"v1"
    before = os.stat(inplace)
    os.utime(built)                                 # newer, same bytes: left alone
    assert not cmd.copy_file(str(built), str(inplace))[1]
    assert os.stat(inplace).st_ino == before.st_ino
    built.write_bytes(b"v2")
    assert cmd.copy_file(str(built), str(inplace))[1] and inplace.read_bytes() == b"v2"
    assert os.stat(inplace).st_ino != before.st_ino          # a new file, not rewritten
    assert sorted(p.name for p in tmp_path.iterdir()) == ["built.so", "inplace.so"]


def test_a_sanitized_build_has_its_own_flags_and_object_files(tmp_path, monkeypatch):
    """POCO_KERNELS_SANITIZE=address: -fsanitize at compile and link, no -O3, the object
    files in a folder of their own (the optimised build's are not recompiled after it);
    an unknown sanitizer is refused."""
    plain = _setup_dist(monkeypatch, tmp_path / "t")
    args = plain.extensions[0].extra_compile_args
    assert "-O3" in args and "-ffp-contract=off" in args
    assert not any("sanitize" in a for a in args + plain.extensions[0].extra_link_args)
    monkeypatch.setenv("POCO_KERNELS_SANITIZE", "undefined,address")
    san = _setup_dist(monkeypatch, tmp_path / "t")
    ext = san.extensions[0]
    assert "-fsanitize=address,undefined" in ext.extra_compile_args
    assert "-fsanitize=address,undefined" in ext.extra_link_args
    assert "-O3" not in ext.extra_compile_args and "-ffp-contract=off" in ext.extra_compile_args
    assert san.build_temp == plain.build_temp + "-sanitize-address-undefined"
    inside = os.path.join(ROOT, "build", "temp.elsewhere")
    assert _setup_dist(monkeypatch, inside).build_temp == inside + "-sanitize-address-undefined"
    monkeypatch.setenv("POCO_KERNELS_SANITIZE", "adress")
    with pytest.raises(ValueError, match="unknown sanitizer"):
        _setup_dist(monkeypatch, tmp_path / "t")
