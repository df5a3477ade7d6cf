#!/usr/bin/env bash
# The portable build (-DDDP_NATIVE=OFF) runs on any x86-64: outside the
# vector kernels, which run only when their family does
# (src/tensor/cpu/family.c), no function of libddp may use an AVX register.
# Lists the functions that do and fails on
#   - AVX-512 (zmm, mask k1-k7) outside the functions compiled for AVX-512
#     on purpose (the target("avx512f") functions of src/tensor/cpu/:
#     *_avx512, the fold and correlate kernels of conv_fold.c, conv.c's
#     transpose and im2col_padded);
#   - AVX2 (ymm) outside those and the AVX2 family's *_avx2 functions;
#   - inside *_avx2, anything AVX-512 adds (zmm, masks, the registers
#     xmm16-31 / ymm16-31, embedded broadcasts {1toN}): an AVX2-only CPU
#     would fault on them.
# Usage: check_portable_isa.sh path/to/libddp.so
set -uo pipefail
lib=${1:?usage: check_portable_isa.sh LIBDDP}
command -v objdump >/dev/null || { echo "SKIP: no objdump (binutils)"; exit 77; }
avx512_ok='^(.*_avx512|correlate[0-9]+|fold_window[0-9]+|fold_taps[0-9]+|transpose|im2col_padded)$'
avx2_ok='^.*_avx2$'
# function <TAB> avx512|avx2, once per function and kind
uses=$(objdump -d --no-show-raw-insn "$lib" |
  awk '/^[0-9a-f]+ <.*>:$/ { fn = substr($2, 2, length($2) - 3) }
       /%zmm[0-9]|%k[1-7]|%[xy]mm(1[6-9]|2[0-9]|3[01])\b|\{1to[0-9]+\}/ { big[fn]++ }
       /%ymm[0-9]/ { ymm[fn]++ }
       END { for (f in big) print f "\tavx512"; for (f in ymm) if (!(f in big)) print f "\tavx2" }' |
  sort)
users=$(cut -f1 <<<"$uses" | sort -u)
[ -n "$users" ] || { echo "FAIL: no function uses AVX registers: are the vector kernels gone from $lib?"; exit 1; }
grep -q $'\tavx512$' <<<"$uses" || { echo "FAIL: no function uses AVX-512 registers: are the AVX-512 kernels gone from $lib?"; exit 1; }
n2=$(awk -F'\t' '$1 ~ /_avx2$/' <<<"$uses" | wc -l)
[ "$n2" -gt 0 ] || { echo "FAIL: no *_avx2 function uses ymm registers: are the AVX2 kernels gone from $lib?"; exit 1; }
bad=$(awk -F'\t' -v a5="$avx512_ok" -v a2="$avx2_ok" '
  $2 == "avx512" && $1 !~ a5 { print $1 " (AVX-512)" }
  $2 == "avx2" && $1 !~ a5 && $1 !~ a2 { print $1 " (AVX)" }' <<<"$uses")
echo "functions with AVX/AVX-512 registers: $(wc -l <<<"$users") (AVX2 kernels: $n2)"
[ -z "$bad" ] || { echo "FAIL: outside the kernels allowed them, these use AVX or AVX-512 instructions:"; echo "$bad"; exit 1; }
echo "ok: $lib runs on any x86-64 outside its dispatched AVX-512 and AVX2 kernels"
