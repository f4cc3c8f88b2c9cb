#!/usr/bin/env bash
# The Python packages the GPU machine lacks, as wheels in .whl/ at the repository root: run this here (it needs
# the network; the GPU machine has none), then name .whl in the device call's `carry`. The device installs them
# with (benchmarks/gpu_suite.py's docstring has the three commands):
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site:.
#
# One pinned version of each, CPython 3.12 on manylinux x86_64, no dependencies: the device has the rest
# (/work/.library/device/KINDS.md lists its packages: torch 2.11 for CUDA 13, triton, transformers, peft,
# accelerate, huggingface-hub 1.33, pyarrow, pandas, fsspec, httpx, requests, xxhash, tqdm, pyyaml...).
# The wheels travel with the working tree, which may be 64 MiB in all: this fails when they do not fit.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
LIMIT=$((64 * 1024 * 1024))

wheels=(
  bitsandbytes==0.50.2  # NF4/INT8 and 8-bit Adam; ships libbitsandbytes_cuda130.so (checked below) for CUDA 13
  liger-kernel==0.8.5   # bench_kernels' reference (needs torch and triton only)
  galore-torch==1.0     # the GaLore parity tests' reference (needs torch, transformers, bitsandbytes)
  datasets==5.2.0       # tests/conftest.py imports it (needs huggingface-hub>=1.31,<3: the device has 1.33)
  dill==0.4.1           # datasets' requirements the device lacks
  multiprocess==0.70.19
)
platforms=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux1_x86_64)
download=(-m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp)
for p in "${platforms[@]}"; do download+=(--platform "$p"); done

if ! git check-ignore -q .whl/probe.whl; then
  echo "error: .whl/ is not ignored by git; add '/.whl/' to .gitignore (or .git/info/exclude) first" >&2
  exit 1
fi
rm -rf .whl
mkdir .whl
for wheel in "${wheels[@]}"; do
  "$PYTHON" "${download[@]}" -d .whl "$wheel"
done

# bitsandbytes picks its library by the CUDA version torch was built for: torch 2.11+cu130 needs cuda130
listing=$(unzip -l .whl/bitsandbytes-*.whl)
if ! grep -q 'bitsandbytes/libbitsandbytes_cuda130\.so' <<<"$listing"; then
  echo "error: the bitsandbytes wheel has no libbitsandbytes_cuda130.so (CUDA 13)" >&2
  exit 1
fi
names=$(ls .whl | sed -E 's/-[0-9].*//' | sort)
if [ "$(echo "$names" | uniq -d)" != "" ]; then
  echo "error: two versions of $(echo "$names" | uniq -d) in .whl (pip installs one of each)" >&2
  exit 1
fi

echo "wheels in .whl/:"
ls -l .whl | awk 'NR > 1 {printf "  %10d  %s\n", $5, $9}'
total=$(du -cb .whl/*.whl | tail -1 | cut -f1)
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | awk '/total$/ {s += $1} END {print s + 0}')
echo "total: $total bytes ($((total / 1024 / 1024)) MiB) of wheels, $tree bytes of working tree; limit $LIMIT"
if [ $((total + tree)) -gt "$LIMIT" ]; then
  echo "error: the wheels and the working tree ($((total + tree)) bytes) exceed the device's 64 MiB" >&2
  exit 1
fi

# DeepSpeed (ZeRO-Offload, the reference gpu_suite skips): is there a binary wheel to carry?
probe=$(mktemp -d)
if "$PYTHON" "${download[@]}" -d "$probe" deepspeed >/dev/null 2>&1; then
  echo "deepspeed: the newest binary wheel is $(ls "$probe") (a current DeepSpeed is a source distribution)"
else
  echo "deepspeed: no binary wheel for CPython 3.12 manylinux x86_64"
fi
rm -rf "$probe"
