"""``benchmarks/gpu/lent_session.sh``, the two device calls of a session with a lent GPU:
it parses, refuses an unknown call, and the commands it runs take the options it
passes (it cannot run here: it needs a GPU)."""
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu", "lent_session.sh")


def test_the_script_parses_and_names_its_calls(tmp_path):
    assert subprocess.run(["bash", "-n", SCRIPT]).returncode == 0
    r = subprocess.run(["bash", SCRIPT, "nonsense"], cwd=ROOT, capture_output=True,
                       text=True, env={**os.environ, "OUT": str(tmp_path)})
    assert r.returncode == 2 and "study|check" in r.stderr
    r = subprocess.run(["bash", SCRIPT, "study"], cwd=ROOT, capture_output=True, text=True,
                       env={k: v for k, v in os.environ.items() if k != "OUT"})
    assert r.returncode != 0 and "OUT must name" in r.stderr
    # a folder to resume without runs in it is refused before anything starts
    (tmp_path / "saved").mkdir()
    r = subprocess.run(["bash", SCRIPT, "study"], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "OUT": str(tmp_path / "out"),
                            "RESUME": str(tmp_path / "saved")})
    assert r.returncode == 2 and "nothing to resume" in r.stderr
    assert not (tmp_path / "out").exists()


def test_the_commands_it_runs_take_its_options():
    from poco_kernels.experiments import lm_study
    text = open(SCRIPT).read()
    assert "--scale gpu-window" in text and "--out-dir /tmp/lm_study_gpu --quiet" in text
    a = lm_study.build_parser().parse_args(["--scale", "gpu-window", "--out-dir",
                                            "/tmp/lm_study_gpu", "--quiet"])
    assert a.scale == "gpu-window" and a.quiet
    assert "bench_gpu.py --quick --out /tmp/quick" in text
    gpu = open(os.path.join(ROOT, "benchmarks", "bench_gpu.py")).read()
    assert 'qa.add_argument("--out"' in gpu
    # the flat microbenchmarks: the options the suite's parser takes
    from benchmarks import run as suite
    micro = ("--backends triton --sizes 16777216 67108864 --dtypes float32 bfloat16 "
             "--skip memory train pretrain table --out /tmp/quick/micro")
    assert micro in " ".join(text.replace("\\\n", " ").split())
    m = suite.build_parser().parse_args(micro.split())
    assert m.sizes == [2 ** 24, 2 ** 26] and set(m.skip) == {"memory", "train", "pretrain",
                                                            "table"}
    # the carried folder is ignored by git, so carrying it is allowed
    assert "gpu_carry/" in open(os.path.join(ROOT, ".gitignore")).read().split()
