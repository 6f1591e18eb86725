#!/usr/bin/env bash
# Run tests against blocktable's compiled part built with AddressSanitizer and UBSan.
#
#   bash tools/asan.sh                      # the tests of the compiled part (and its fuzz)
#   bash tools/asan.sh tests/               # the whole suite
#   bash tools/asan.sh -s tests/test_x.py  # with a failure's report (pytest captures stderr)
#
# Builds the extension with -fsanitize=address,undefined into a fresh copy of the source
# tree (the installed package is left alone), then runs pytest there with both runtimes
# preloaded. Needs gcc with its sanitizer runtimes (Debian/Ubuntu: gcc, libasan, libubsan)
# and an environment with the package's test extras and Cython.
set -euo pipefail
if [ $# -eq 0 ]; then
  set -- tests/test_compiled.py tests/test_compiled_tokens.py tests/test_key_table.py
fi
top=$(cd "$(dirname "$0")/.." && pwd)
asan=$(gcc -print-file-name=libasan.so)
ubsan=$(gcc -print-file-name=libubsan.so)
if [ ! -e "$asan" ] || [ ! -e "$ubsan" ]; then
  echo "tools/asan.sh: gcc's libasan/libubsan were not found; install them to run this" >&2
  exit 2
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r "$top/src" "$top/tests" "$top/setup.py" "$top/pyproject.toml" "$top/README.md" "$work/"
find "$work/src" -name "_compiled*.so" -delete
cd "$work"
flags="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all -O1"
CFLAGS="$flags" LDFLAGS="-fsanitize=address,undefined" python setup.py -q build_ext --inplace \
  >/dev/null
# every Python object comes from malloc (PYTHONMALLOC), so a stale reference to one is caught
# too; leaks are not checked, errors are
LD_PRELOAD="$asan $ubsan" PYTHONMALLOC=malloc ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
  UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 PYTHONPATH="$work/src" \
  python -m pytest -q -p no:cacheprovider "$@"
