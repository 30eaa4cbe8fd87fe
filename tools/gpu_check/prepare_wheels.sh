#!/usr/bin/env bash
# Downloads, HERE (a machine that reaches PyPI), the wheels tools/gpu_check.sh installs on the
# GPU machine, which reaches nothing: what Laya, its torch and exl2 backends, the C++ router's
# build and the OpenAI battery need and that machine's image lacks, plus exllamav2.
#
#   tools/gpu_check/prepare_wheels.sh [PYTHON_VERSION]    # default 3.12 (the image's python3)
#
# Into tools/gpu_check/wheels/ (ignored by git; a GPU run carries it: run's carry list names
# "tools/gpu_check/wheels"), with requirements.txt beside them (what each top-level
# requirement asks, for setup_env.py's "the machine's own version will do" check). Only
# CPython wheels for manylinux x86-64 (--only-binary=:all:). The machine's packages
# (device_packages.txt) are left out but for the router's build tools, whose versions
# matter. Prints the total, which must stay well under the 64 MiB that may travel.
set -euo pipefail

PY_VERSION=${1:-3.12}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
OUT_DIR=${GPU_CHECK_WHEELS:-$HERE/wheels}
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
[[ -x $PYTHON ]] || PYTHON=python3
EXLLAMAV2=exllamav2==0.3.2   # PyPI's last; a py3-none-any wheel compiled at first import
ALWAYS_CARRY=" scikit-build-core nanobind "
LIMIT_MIB=48                 # of the 64 MiB a run may carry, the rest is the tree itself

platforms=()
for n in 17 24 27 28 31 34 35 38 39; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
target=(--only-binary=:all: --python-version "$PY_VERSION" --implementation cp "${platforms[@]}")

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cd "$REPO"
"$PYTHON" "$HERE/requirements.py" "$PY_VERSION" >"$scratch/requirements.txt"
echo "requirements (Python $PY_VERSION): $(tr '\n' ' ' <"$scratch/requirements.txt")"
"$PYTHON" -m pip download --quiet "${target[@]}" -d "$scratch/all" -r "$scratch/requirements.txt"
"$PYTHON" -m pip download --quiet --no-deps "${target[@]}" -d "$scratch/all" "$EXLLAMAV2"

rm -rf "$OUT_DIR"
mkdir -p "$OUT_DIR"
cp "$scratch/requirements.txt" "$OUT_DIR/requirements.txt"
canonical() { echo "$1" | tr 'A-Z_.' 'a-z--'; }
while read -r name; do
    [[ $name == \#* || -z $name ]] && continue
    echo " $(canonical "$name") "
done <"$HERE/device_packages.txt" >"$scratch/machine_has"
for wheel in "$scratch"/all/*.whl; do
    name=$(canonical "$(basename "$wheel" | cut -d- -f1)")
    if grep -qx " $name " "$scratch/machine_has" && [[ $ALWAYS_CARRY != *" $name "* ]]; then
        continue
    fi
    cp "$wheel" "$OUT_DIR/"
done

ls -1 "$OUT_DIR"
total=$(du -cb "$OUT_DIR"/* | tail -1 | cut -f1)
mib=$(( (total + 1048575) / 1048576 ))
count=$(find "$OUT_DIR" -name '*.whl' | wc -l)
echo "prepare_wheels: $count wheels, ${mib} MiB in $OUT_DIR"
if (( mib > LIMIT_MIB )); then
    echo "prepare_wheels: over ${LIMIT_MIB} MiB: a GPU run could not carry them with the tree" >&2
    exit 1
fi
