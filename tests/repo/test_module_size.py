"""No module over about 400 lines: every source file of the package, its C++ extension, its
tests and its benchmarks is short enough to read in one sitting.  A file that grows past
the limit is split by topic (the new files' names say what each part holds), not given
an exemption here."""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIMIT = 410                                  # "about 400"
TOPS = ("poco_kernels", "csrc", "tests", "benchmarks")
SUFFIXES = (".py", ".h", ".cpp", ".sh")
SKIP_DIRS = {"__pycache__", "build", "results", ".venv"}


def oversize(root, tops=TOPS, limit=LIMIT):
    """(path relative to root, line count) of each source file under ``tops`` longer than
    ``limit`` lines."""
    out = []
    for top in tops:
        for dirpath, dirnames, files in os.walk(os.path.join(root, top)):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
            for name in sorted(files):
                if not name.endswith(SUFFIXES):
                    continue
                path = os.path.join(dirpath, name)
                with open(path, encoding="utf-8") as f:
                    n = sum(1 for _ in f)
                if n > limit:
                    out.append((os.path.relpath(path, root), n))
    return out


def test_no_module_over_about_400_lines():
    found = oversize(ROOT)
    assert not found, (f"over {LIMIT} lines (split them by topic): "
                       + ", ".join(f"{p} ({n})" for p, n in found))


def test_the_scan_finds_a_long_file_and_skips_build_outputs(tmp_path):
    (tmp_path / "csrc").mkdir()
    (tmp_path / "csrc" / "long.h").write_text("x\n" * (LIMIT + 1))
    (tmp_path / "csrc" / "short.cpp").write_text("x\n" * LIMIT)
    (tmp_path / "csrc" / "notes.md").write_text("x\n" * (LIMIT + 5))
    (tmp_path / "tests" / "build").mkdir(parents=True)
    (tmp_path / "tests" / "build" / "gen.py").write_text("x\n" * (LIMIT + 5))
    assert oversize(str(tmp_path)) == [(os.path.join("csrc", "long.h"), LIMIT + 1)]
