#!/usr/bin/env bash
# The AVX-512 kernels unchanged: compiles src/tensor/cpu/*.c as of BASE
# (a commit; default main) and as in the work tree, without -march=native
# (as the portable build does, so that only the target("avx512f") functions
# use zmm or mask registers), and compares the disassembly of every
# function that uses them or is named as an AVX-512 kernel (*_avx512 and
# the names tests/tensor/check_portable_isa.sh allows; not cpu/conv.c's
# plain-C drivers forward_avx512 and backward_avx512, which became
# forward_vec and backward_vec, shared by the AVX-512 and AVX2 families,
# nor the family predicate ddp__cpu_has_avx512 of cpu/family.c), addresses
# and the compiler's clone suffixes normalised away. Prints each file's count of such functions; fails on any
# difference. Usage: scripts/check-avx512-disasm.sh [BASE]
set -euo pipefail
cd "$(dirname "$0")/.."
base=${1:-main}
command -v objdump >/dev/null || { echo "SKIP: no objdump (binutils)"; exit 77; }
cc=${CC:-cc}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
flags=(-O2 -g -fPIC -fno-strict-aliasing -fno-math-errno -fvect-cost-model=dynamic
       -fno-semantic-interposition -std=c11 -D_GNU_SOURCE -w)
mkdir -p "$tmp/base/src" "$tmp/now"
git archive "$base" src include | tar -x -C "$tmp/base"
# The AVX-512 functions' disassembly of one object, one normalised listing.
kernels() {
  objdump -d --no-show-raw-insn "$1" | awk '
    /^[0-9a-f]+ <.*>:$/ { fn = substr($2, 2, length($2) - 3); next }
    fn != "" && NF { body[fn] = body[fn] $0 "\n"; if ($0 ~ /%zmm[0-9]|%k[1-7]/) z[fn] = 1 }
    fn ~ /_avx512(\.|$)|^(correlate|fold_window|fold_taps)[0-9]+$|^(transpose|im2col_padded)$/ &&
      fn !~ /^((forward|backward)_avx512|ddp__cpu_has_avx512)$/ { z[fn] = 1 }
    END { for (f in z) printf "== %s\n%s", f, body[f] }' |
    sed -E 's/^ *[0-9a-f]+:\t//; s/\b[0-9a-f]+ </</g; s/0x[0-9a-f]+\(%rip\)/X(%rip)/g;
            s/\.(isra|constprop|part|cold)\.[0-9]+//g' |
    awk '/^== / { name = $0; next } { print name "\t" $0 }' | sort -s -k1,1
}
status=0
for src in "$tmp"/base/src/tensor/cpu/*.c; do
  f=$(basename "$src")
  "$cc" "${flags[@]}" -I"$tmp/base/include" -I"$tmp/base/src" -c "$src" -o "$tmp/base/$f.o"
  "$cc" "${flags[@]}" -Iinclude -Isrc -c "src/tensor/cpu/$f" -o "$tmp/now/$f.o"
  kernels "$tmp/base/$f.o" >"$tmp/base/$f.s"
  kernels "$tmp/now/$f.o" >"$tmp/now/$f.s"
  n=$(cut -f1 "$tmp/base/$f.s" | sort -u | grep -c . || true)
  if cmp -s "$tmp/base/$f.s" "$tmp/now/$f.s"; then
    echo "$f: $n AVX-512 functions, the same"
  else
    echo "$f: the AVX-512 functions differ from $base:"
    diff "$tmp/base/$f.s" "$tmp/now/$f.s" | head -20
    status=1
  fi
done
exit $status
