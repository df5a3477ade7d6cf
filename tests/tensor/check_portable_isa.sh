#!/usr/bin/env bash
# The portable build (-DDDP_NATIVE=OFF) runs on any x86-64: outside the
# AVX-512 kernels, which run only when ddp__cpu_has_avx512() says so
# (src/tensor/cpu/family.c), no function of libddp may use an AVX or
# AVX-512 register (ymm, zmm, mask k1-k7). Lists the functions that do and
# fails on any not compiled for AVX-512 on purpose (the target("avx512f")
# functions of src/tensor/cpu/: *_avx512, the fold and correlate kernels of
# conv_fold.c, conv.c's transpose and im2col_padded).
# Usage: check_portable_isa.sh path/to/libddp.so
set -uo pipefail
lib=${1:?usage: check_portable_isa.sh LIBDDP}
command -v objdump >/dev/null || { echo "SKIP: no objdump (binutils)"; exit 77; }
allowed='^(.*_avx512|correlate[0-9]+|fold_window[0-9]+|fold_taps[0-9]+|transpose|im2col_padded)$'
users=$(objdump -d --no-show-raw-insn "$lib" |
  awk '/^[0-9a-f]+ <.*>:$/ { fn = substr($2, 2, length($2) - 3) }
       /%(ymm|zmm)[0-9]|%k[1-7]/ { n[fn]++ }
       END { for (f in n) print f }' | sort)
[ -n "$users" ] || { echo "FAIL: no function uses AVX-512 registers: are the AVX-512 kernels gone from $lib?"; exit 1; }
bad=$(grep -Ev "$allowed" <<<"$users")
echo "functions with AVX/AVX-512 registers: $(wc -l <<<"$users") (all AVX-512 kernels: $([ -z "$bad" ] && echo yes || echo no))"
[ -z "$bad" ] || { echo "FAIL: outside the AVX-512 kernels, these use AVX/AVX-512 registers:"; echo "$bad"; exit 1; }
echo "ok: $lib runs on any x86-64 outside its dispatched AVX-512 kernels"
