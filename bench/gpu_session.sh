#!/usr/bin/env bash
# A lent GPU's checks in one call (about 9 minutes on an H200): the MFU sweep first (issue 31's
# figures: the shipped compiled phases, then variants of phase 8), then the pipeline's GPU check
# cut to the fast phases with the 320^3 inference against MONAI. Each has a timeout of its own,
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

timeout "${MFU_TIMEOUT_S:-300}" python3 bench/mfu.py --json "$out/mfu.json" >"$out/mfu.log" 2>&1
echo "mfu exit $?" | tee -a "$out/gpu.txt"
grep -v '^USDT' "$out/mfu.log" | tail -40

timeout "${CHECK_TIMEOUT_S:-250}" python3 bench/gpu_check.py --phases 6 8 --train-phase 8 \
  --train-steps 60 --fine-tune-steps 0 --json "$out/gpu_check.json" >"$out/gpu_check.log" 2>&1
echo "gpu_check exit $?" | tee -a "$out/gpu.txt"
grep '^RESULT' "$out/gpu_check.log"
