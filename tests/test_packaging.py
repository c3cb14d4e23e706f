"""The README holds exactly two set-up-and-run commands, and CI runs the test one."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
