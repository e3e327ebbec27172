#!/usr/bin/env bash
# Build the compiled data path with AddressSanitizer and UndefinedBehaviorSanitizer in a
# scratch copy of the source, and run its tests - the 1M-datagram fuzz, the differential
# tests against the Python path (DATA and ACKs), the parser check - against that build. Any
# out-of-bounds access or undefined behaviour aborts the run.
#   bash tools/native-asan.sh            (from the repository, in its virtual environment)
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r src setup.py pyproject.toml README.md "$work"/
rm -f "$work"/src/boundedloss/_native*.so
(cd "$work" && BOUNDEDLOSS_NATIVE_CFLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all -O1" \
    python setup.py -q build_ext --inplace >/dev/null)
ls "$work"/src/boundedloss/_native*.so >/dev/null
export PYTHONPATH="$work/src"
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1
export LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)"
python -c "import boundedloss._native as n, sys; sys.exit(0 if n.__file__.startswith('$work') else 1)"
python -m pytest -q -p no:cacheprovider tests/test_native.py tests/test_native_acks.py
