#!/usr/bin/env bash
# Check the SPIN model of the round protocol (tests/model/round_protocol.pml).
#
#   check.sh [--expect ok | --expect-error TEXT] [--pan FLAG]... [-DNAME]... [MODEL]
#
# Generates the verifier with `spin -a -DNAME... MODEL`, compiles it with the system C
# compiler (${EPMOE_MODEL_CC:-cc}) in a temporary directory, runs an exhaustive
# safety search (assertions + invalid end states) and checks the verdict:
#   --expect ok            (default) complete search, "errors: 0", and every statement
#                          of proctype rank reached (a model that never gets to part
#                          of the protocol proves nothing about it)
#   --expect-error TEXT    "errors: 1", and the error pan reports contains TEXT
#                          (e.g. "invalid end state", "assertion violated (pay");
#                          the counterexample's final state is printed
# --pan FLAG passes FLAG to pan (e.g. -E: do not report invalid end states).
# Exit 0 when the verdict is the expected one, 1 otherwise; a missing spin or C
# compiler is a failure, not a skip.
# EPMOE_MODEL_KEEP=1 keeps the temporary directory (pan, pan.log, the trail).
set -u

here=$(cd "$(dirname "$0")" && pwd)
model=$here/round_protocol.pml
expect=ok
expect_text=
defines=()
pan_flags=()
pan_str=

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

while [ $# -gt 0 ]; do
  case $1 in
    --expect)
      [ $# -ge 2 ] || fail "--expect needs an argument"
      [ "$2" = ok ] || fail "--expect takes only 'ok'; use --expect-error TEXT"
      expect=ok
      shift 2
      ;;
    --expect-error)
      if [ $# -lt 2 ] || [ -z "$2" ]; then
        fail "--expect-error needs the error text"
      fi
      expect=error
      expect_text=$2
      shift 2
      ;;
    --pan)
      [ $# -ge 2 ] || fail "--pan needs a flag"
      pan_flags+=("$2")
      pan_str="$pan_str $2"
      shift 2
      ;;
    -D*)
      defines+=("$1")
      shift
      ;;
    -*)
      fail "unknown option: $1"
      ;;
    *)
      model=$1
      shift
      ;;
  esac
done

[ -f "$model" ] || fail "model not found: $model"

if ! command -v spin >/dev/null 2>&1; then
  fail "spin is not installed, so the protocol model cannot be checked." \
       "Install the Debian package: apt-get install -y spin (scripts/setup.sh does)."
fi
cc=${EPMOE_MODEL_CC:-cc}
command -v "$cc" >/dev/null 2>&1 || fail "no C compiler '$cc' to build SPIN's verifier"

work=$(mktemp -d "${TMPDIR:-/tmp}/epmoe-model.XXXXXX") || fail "mktemp failed"
if [ "${EPMOE_MODEL_KEEP:-0}" = 1 ]; then
  echo "keeping $work"
else
  trap 'rm -rf "$work"' EXIT
fi
name=$(basename "$model")
cp "$model" "$work/$name" || fail "cannot copy $model to $work"
cd "$work" || fail "cannot enter $work"

echo "model: $model ${defines[*]:-}"
echo "expect: ${expect}${expect_text:+: $expect_text}"
[ -z "$pan_str" ] || echo "pan flags:$pan_str"

# 1. the verifier's C source
if ! spin -a ${defines[@]+"${defines[@]}"} "$name" >spin.log 2>&1; then
  cat spin.log
  fail "spin -a rejected the model"
fi
# 2. compile: safety only (assertions, invalid end states), exhaustive search with
#    partial-order reduction; COLLAPSE compresses stored states (still exhaustive);
#    MEMLIM (MB) makes pan stop with a message instead of exhausting the machine.
if ! "$cc" -O2 -w -DSAFETY -DCOLLAPSE -DMEMLIM=1024 -o pan pan.c >cc.log 2>&1; then
  cat cc.log
  fail "compiling pan.c with $cc failed"
fi
# 3. search
start=$(date +%s)
./pan -m100000 ${pan_flags[@]+"${pan_flags[@]}"} >pan.log 2>&1
pan_rc=$?
end=$(date +%s)
grep -v '^Depth=' pan.log
echo "pan exit status $pan_rc, $((end - start)) s wall"

[ "$pan_rc" -eq 0 ] || fail "pan exited with status $pan_rc"
errors=$(sed -n 's/.*errors: \([0-9][0-9]*\).*/\1/p' pan.log | tail -n 1)
[ -n "$errors" ] || fail "no 'errors: N' summary in pan's output"
if grep -q 'max search depth too small' pan.log; then
  fail "search depth limit hit: raise -m"
fi
if grep -q -e 'reached -DMEMLIM bound' -e 'out of memory' pan.log; then
  fail "pan ran out of memory: the search is incomplete"
fi

summary() {
  stored=$(sed -n 's/^ *\([0-9.e+]*\) states, stored.*/\1/p' pan.log)
  echo "SPIN: ${stored:-?} states stored, errors: $errors"
}

if [ "$expect" = ok ]; then
  if [ "$errors" -ne 0 ]; then
    grep '^pan:[0-9]*:' pan.log
    if [ -f "$name.trail" ]; then
      echo "--- counterexample (spin -t -p), last 60 lines:"
      spin -t -p ${defines[@]+"${defines[@]}"} "$name" 2>&1 | tail -n 60
    fi
    fail "SPIN found $errors error(s); expected none"
  fi
  grep -q 'Search not completed' pan.log && fail "the search did not complete"
  grep -q '^Full statespace search' pan.log || fail "not a full state-space search"
  # every statement of proctype rank must be reachable
  unreached=$(awk '/^unreached in proctype rank$/ { on = 1; next }
                   on && /^unreached in/ { on = 0 }
                   on && /of [0-9]+ states\)/ { print; on = 0 }' pan.log)
  case $unreached in
    *"(0 of "*) ;;
    *) fail "statements of proctype rank were never reached: ${unreached:-no listing}" ;;
  esac
  summary
  echo "PASS: SPIN found no error${pan_str:+ (pan$pan_str)}"
  exit 0
fi

# expect an error
if [ "$errors" -ne 1 ]; then
  fail "expected SPIN to report exactly one error ('$expect_text'), got errors: $errors"
fi
first=$(grep -m 1 '^pan:1:' pan.log)
case $first in
  *"$expect_text"*) ;;
  *) fail "SPIN reported '${first:-nothing}', expected an error containing '$expect_text'" ;;
esac
[ -f "$name.trail" ] || fail "pan wrote no trail for the error"
echo "--- counterexample: final state (spin -t)"
spin -t ${defines[@]+"${defines[@]}"} "$name" 2>&1 |
  grep -v -e '^[[:space:]]*\(cnt\|dn\|pay\|res\)\[' -e '^#processes'
summary
echo "PASS: SPIN reports the expected error: $first"
exit 0
