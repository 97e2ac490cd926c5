#!/usr/bin/env bash
# A lent GPU's checks in one call (under 10 minutes on an H200): the pipeline's GPU check cut to
# the fast phases with the 320^3 inference against MONAI, then the MFU sweep (issue 31's
# figures: the shipped compiled phases, then variants of phase 8). Each has a timeout of its own,
# and each writes its figures as it goes, so a cut run keeps what it measured.
#
#   ../shared/tools/gpu-wheels.sh          # here, once: the wheels the GPU image lacks, into .whl/
#   bash bench/gpu_session.sh              # there, from the repository root (device: carry .whl)
#
# Figures and logs go to $OUT (default results/bench/gpu_session/).
set -u
cd "$(dirname "$0")/.."
out=${OUT:-results/bench/gpu_session}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/workflow
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/gpu.txt" 2>&1
python3 -c "import torch; print('torch', torch.__version__, 'cudnn', torch.backends.cudnn.version())" \
  >>"$out/gpu.txt" 2>&1

# The GPU check first (issue 31's order): phases 6 and 8, a short training, then the 320^3
# inference against MONAI; on an H200, 278 s before the comparison and about 50 s for it.
timeout "${CHECK_TIMEOUT_S:-360}" python3 bench/gpu_check.py --phases 6 8 --train-phase 8 \
  --train-steps 30 --fine-tune-steps 0 --json "$out/gpu_check.json" >"$out/gpu_check.log" 2>&1
echo "gpu_check exit $?" | tee -a "$out/gpu.txt"
grep '^RESULT' "$out/gpu_check.log"

# Then the sweep, inside what is left of a 10-minute call (a variant takes about 55 s on an
# H200, compilation included, so the budget fits the baseline and two more).
# MFU_VARIANTS (names, space-separated) narrows it to what a session still has to measure.
timeout "${MFU_TIMEOUT_S:-215}" python3 bench/mfu.py --budget-s "${MFU_BUDGET_S:-160}" \
  ${MFU_VARIANTS:+--variants $MFU_VARIANTS} --json "$out/mfu.json" >"$out/mfu.log" 2>&1
echo "mfu exit $?" | tee -a "$out/gpu.txt"
grep -v '^USDT' "$out/mfu.log" | cut -c1-400 | tail -40
