#!/bin/sh
# What a shared library exports (nm -D --defined-only), for the ctests of
# shadowsync_add_export_tests (cmake/ShadowsyncTesting.cmake):
#   check_exports.sh NM LIBRARY none PREFIX       no exported symbol's name starts with PREFIX
#   check_exports.sh NM LIBRARY all SYMBOL...     every SYMBOL is exported
# Either way LIBRARY must export shadowsync_get_c_api_version, so that a failing nm or the wrong
# file cannot pass. Exit status 0: as expected; 1: not; 2: nm failed, the file is not the C ABI's
# library, or the arguments are wrong.
set -u
if [ $# -lt 4 ]; then
  echo "usage: check_exports.sh NM LIBRARY none PREFIX | NM LIBRARY all SYMBOL..." >&2
  exit 2
fi
nm=$1 library=$2 mode=$3
shift 3
if ! listing=$("$nm" -D --defined-only "$library"); then
  echo "check_exports: '$nm -D --defined-only $library' failed" >&2
  exit 2
fi
# The last field of each line is the name, possibly with a version (name@VERSION).
names=$(printf '%s\n' "$listing" | awk 'NF { print $NF }' | sed 's/@.*//')
exports() { printf '%s\n' "$names" | grep -qx -- "$1"; }
if ! exports shadowsync_get_c_api_version; then
  echo "check_exports: $library exports no shadowsync_get_c_api_version: not the C ABI's library" >&2
  exit 2
fi
case $mode in
  none)
    found=$(printf '%s\n' "$names" | grep -- "^$1" || true)
    if [ -n "$found" ]; then
      echo "$library exports symbols starting with $1, which it must not:"
      printf '%s\n' "$found"
      exit 1
    fi
    ;;
  all)
    for symbol in "$@"; do
      if ! exports "$symbol"; then
        echo "$library does not export $symbol"
        exit 1
      fi
    done
    ;;
  *)
    echo "check_exports: unknown mode '$mode' (none or all)" >&2
    exit 2
    ;;
esac
echo "$library: exports as expected ($mode $*)"
