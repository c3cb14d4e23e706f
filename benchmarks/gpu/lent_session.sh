#!/usr/bin/env bash
# A session with a lent GPU, in two device calls (docs/benchmarks.md, 'A lent GPU'):
#
#   bash benchmarks/gpu/lent_session.sh study   # call 1, at most 8 minutes
#   bash benchmarks/gpu/lent_session.sh check   # call 2, at most 6 minutes, right after
#                                               # (9 when it builds the extension first)
#
# study: the C++ extension is built (-O3, beside the study, into /tmp; 4 jobs at the
#   lowest priority, leaving the study's 5 processes most of the 16 cores) while the LM
#   study's GPU window trains (`lm_study --scale gpu-window`); the extension goes into
#   place once the study has ended (a worker never imports a half-written one).
# check: the quick GPU check (`bench_gpu.py --quick`) with that extension, so with the
#   parked default, then `studies/host_profile.py` (where the host time goes) and the
#   flat kernels' microbenchmarks at 2^24 and 2^26 elements (Triton rows only). A machine
#   given back between the calls loses the build: then the extension that call 1
#   returned, carried in `gpu_carry/` (git-ignored), is used, and without one `check`
#   builds it first (all 16 cores, about 2 minutes, at most 3: `check` alone then fits
#   one device call, whose limit is 10 minutes).  The timeouts below add up to 8.5
#   minutes, so the archive is written before a call's limit whatever runs long.
# Each call packs its outputs into one archive under $OUT (a device call returns at most
# 8 files); RESUME=<a saved study's folder> (carried) makes `study` resume its runs.
# Exit status: 0 when everything ran and passed, else the failing command's.
set -u
: "${OUT:?OUT must name the folder whose files come back}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi -L 2>/dev/null
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

case "${1:-}" in
study)
  rm -rf /tmp/poco_ext /tmp/lm_study_gpu
  mkdir -p /tmp/lm_study_gpu
  if [ -n "${RESUME:-}" ]; then
    if [ ! -d "$RESUME/runs" ]; then
      echo "RESUME=$RESUME holds no runs/ folder: nothing to resume" >&2
      exit 2
    fi
    cp -r "$RESUME"/. /tmp/lm_study_gpu/ || exit 2
  fi
  (nice -n 19 env MAX_JOBS=4 timeout 420 python3 setup.py build_ext --build-lib /tmp/poco_ext \
     > /tmp/build.log 2>&1; echo "build rc=$?" >> /tmp/build.log) &
  t0=$(date +%s)
  timeout 455 python3 -m poco_kernels.experiments.lm_study --scale gpu-window \
    --out-dir /tmp/lm_study_gpu --quiet > /tmp/lm_study_gpu/lm.log 2>&1
  rc=$?
  echo "lm_study rc=$rc in $(( $(date +%s) - t0 )) s"
  wait
  tail -n 2 /tmp/build.log
  grep -m 3 -B 2 -A 6 "error" /tmp/build.log > /tmp/lm_study_gpu/build_errors.txt
  if grep -q "^build rc=0" /tmp/build.log; then
    for so in /tmp/poco_ext/poco_kernels/_C*.so; do
      [ -f "$so" ] || continue
      cp "$so" poco_kernels/ && echo "extension built and in place"
      # (returned without debug information: a returned file is at most 16 MB)
      strip --strip-debug -o "$OUT/$(basename "$so")" "$so" || echo "extension not returned"
    done
  else
    echo "extension NOT built (build_errors.txt)"
  fi
  # (the archive holds the study's folder's contents: unpack it where the study goes)
  tar czf "$OUT/lm_study_gpu.tgz" -C /tmp/lm_study_gpu .
  tail -n 30 /tmp/lm_study_gpu/lm.log
  exit "$rc"
  ;;
check)
  if ! ls poco_kernels/_C*.so > /dev/null 2>&1; then
    cp gpu_carry/_C*.so poco_kernels/ 2>/dev/null && echo "extension from gpu_carry/"
  fi
  if ! ls poco_kernels/_C*.so > /dev/null 2>&1; then
    # (a fresh machine, nothing carried: built here, every core, about 2 minutes)
    t0=$(date +%s)
    MAX_JOBS=16 timeout 180 python3 setup.py build_ext --inplace > /tmp/build.log 2>&1
    echo "extension built here: rc=$? in $(( $(date +%s) - t0 )) s"
  fi
  python3 -c "from poco_kernels import _sweeps; print('parking:', _sweeps.park is not None)"
  rm -rf /tmp/quick
  mkdir -p /tmp/quick
  timeout 200 python3 benchmarks/bench_gpu.py --quick --out /tmp/quick > /tmp/quick.log 2>&1
  rc=$?
  echo "quick rc=$rc"
  # where the host time goes (cProfile, kernel launches and synchronisations per iteration)
  timeout 45 python3 -m benchmarks.studies.host_profile --kinds adamw_fused ivon ivon_pocomo \
    --iters 100 --profile-iters 50 --out /tmp/quick/host_profile > /tmp/host_profile.log 2>&1
  echo "host_profile rc=$?"
  # the flat kernels' share of copy bandwidth at 2^24 and 2^26 (about 30 s)
  timeout 75 python3 benchmarks/bench_gpu.py --only bench --backends triton \
    --sizes 16777216 67108864 --dtypes float32 bfloat16 \
    --skip memory train pretrain table --out /tmp/quick/micro > /tmp/micro.log 2>&1
  echo "micro rc=$?"
  cp /tmp/quick.log /tmp/host_profile.log /tmp/micro.log /tmp/quick/
  cp /tmp/build.log /tmp/quick/ 2>/dev/null
  tar czf "$OUT/quick.tgz" -C /tmp/quick .
  cat /tmp/quick/quick.md 2>/dev/null || tail -n 30 /tmp/quick.log
  exit "$rc"
  ;;
*)
  echo "usage: bash benchmarks/gpu/lent_session.sh study|check" >&2
  exit 2
  ;;
esac
