#!/usr/bin/env bash
# ddp as an installed library (docs/install.md), from a build directory:
#  1. `cmake --install BUILD --prefix TMP` puts exactly the public headers,
#     libddp.so (soname libddp.so.0) and libddp.a, the tools, ddp.pc and the
#     CMake package there: no internal header, test, benchmark or example;
#  2. libddp.so exports ddp_ names only, each declared in an installed
#     header: no ddp__ internal (libddp.a has them), nothing unprefixed;
#  3. the headers' version, ddp_version(), ddp.pc's, the CMake package's and
#     each tool's --version all say CMake's project version (DDP_VERSION);
#  4. examples/basic_training.c built out of tree four ways: pkg-config
#     (libddp.so), pkg-config --static (libddp.a), find_package(ddp) with
#     ddp::ddp and with ddp::ddp_static. Each links the library it should
#     and prints, line for line, what the in-tree build's basic_training
#     prints, its loss going down over the 5 steps.
# Under a sanitizer (DDP_SANITIZER) the installed libraries are
# instrumented, so the out-of-tree builds get the same -fsanitize flags.
# Needs pkg-config and binutils (SKIP, exit 77, without them).
# Usage: test_install.sh BUILD_DIR
set -uo pipefail
skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }

build=${1:?usage: test_install.sh BUILD_DIR}
src=${DDP_SOURCE_DIR:?}
version=${DDP_VERSION:?}
bin=${DDP_BIN_DIR:?}
cmake=${CMAKE:-cmake}
cc=${CC:-cc}
command -v pkg-config >/dev/null || skip "no pkg-config"
for t in nm readelf ldd; do command -v $t >/dev/null || skip "no $t"; done
case ${DDP_SANITIZER:-} in
  address) san="-fsanitize=address,undefined -fno-omit-frame-pointer" ;;
  thread) san="-fsanitize=thread" ;;
  *) san="" ;;
esac
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
trap 'exit 143' TERM INT # through the EXIT trap
prefix=$tmp/prefix
example=$src/examples/basic_training.c

# ---- 1. What is installed ----
"$cmake" --install "$build" --prefix "$prefix" >"$tmp/install.log" 2>&1 ||
  { cat "$tmp/install.log"; fail "cmake --install $build failed"; }
pc=$(find "$prefix" -name ddp.pc)
[ -f "$pc" ] || fail "no ddp.pc under $prefix"
lib=$(dirname "$(dirname "$pc")")
want=$(cd "$src/include" && ls ddp/*.h)
got=$(cd "$prefix/include" && find . -type f | sed 's|^\./||' | sort)
[ "$want" = "$got" ] ||
  fail "installed headers are not include/ddp/*.h: $(diff <(echo "$want") <(echo "$got") | grep '^[<>]' | tr '\n' ' ')"
for f in libddp.so libddp.so.0 "libddp.so.$version" libddp.a cmake/ddp/ddpConfig.cmake \
         cmake/ddp/ddpConfigVersion.cmake cmake/ddp/ddpTargets.cmake; do
  [ -e "$lib/$f" ] || fail "$lib/$f is not installed"
done
soname=$(readelf -d "$lib/libddp.so" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
[ "$soname" = libddp.so.0 ] || fail "libddp.so's soname is '$soname', not libddp.so.0"
want=$(cd "$src/tools" && ls *.c | sed 's/\.c$//')
got=$(ls "$prefix/bin")
[ "$want" = "$got" ] ||
  fail "installed programs are not the tools: $(diff <(echo "$want") <(echo "$got") | grep '^[<>]' | tr '\n' ' ')"
for t in $got; do
  out=$("$prefix/bin/$t" --version 2>&1)
  [ "$out" = "$t (ddp) $version" ] || fail "$t --version printed '$out', not '$t (ddp) $version'"
done
echo "installed: $(echo "$want" | wc -w) tools, $(ls "$prefix/include/ddp" | wc -l) headers, libddp.so.$version, libddp.a, ddp.pc, CMake package"

# ---- 2. What libddp.so exports ----
nm -D --defined-only "$lib/libddp.so" | awk '{print $3}' | sort -u >"$tmp/exports"
internal=$(grep '^ddp__' "$tmp/exports" | head -5)
[ -z "$internal" ] || fail "libddp.so exports internals: $internal ..."
stray=$(grep -v '^ddp_' "$tmp/exports" | head -5)
[ -z "$stray" ] || fail "libddp.so exports names without the ddp_ prefix: $stray ..."
for s in ddp_tensor_create ddp_version ddp_allreduce; do
  grep -qx "$s" "$tmp/exports" || fail "libddp.so does not export $s"
done
cat "$prefix"/include/ddp/*.h | grep -o '\bddp_[a-z0-9_]*[[:space:]]*(' | sed 's/[[:space:]]*($//' |
  sort -u >"$tmp/declared"
undeclared=$(comm -23 "$tmp/exports" "$tmp/declared" | head -5)
[ -z "$undeclared" ] ||
  fail "libddp.so exports names no installed header declares (an internal function is ddp__ or static): $undeclared"
internals=$(nm "$lib/libddp.a" 2>/dev/null | grep -c ' T ddp__')
[ "$internals" -gt 0 ] || fail "libddp.a defines no ddp__ function: the internals went missing"
echo "libddp.so exports $(wc -l <"$tmp/exports") ddp_ names, no ddp__ (libddp.a defines $internals)"

# ---- 3 and 4. Programs built out of tree ----
export PKG_CONFIG_PATH=$lib/pkgconfig
[ "$(pkg-config --modversion ddp)" = "$version" ] ||
  fail "ddp.pc says version $(pkg-config --modversion ddp), not $version"
cflags=(-std=c11 -O2 -Wall -Wextra -Werror $san)
compile() { # OUT SOURCE FLAGS...
  local out=$1 source=$2; shift 2
  "$cc" "${cflags[@]}" "$source" "$@" -o "$tmp/$out" >"$tmp/$out.log" 2>&1 ||
    { cat "$tmp/$out.log"; fail "building $out failed: $cc ${cflags[*]} $source $*"; }
}
# Whether $1 needs libddp.so.0 (then it must load it from the prefix): yes or no.
links_shared() {
  local needed loaded
  needed=$(readelf -d "$tmp/$1" | grep 'NEEDED.*libddp')
  [ -n "$needed" ] || { echo no; return; }
  loaded=$(LD_LIBRARY_PATH=$lib ldd "$tmp/$1" | grep libddp)
  case $loaded in
    *"libddp.so.0 => $lib/libddp.so.0 "*) echo yes ;;
    *) echo "libddp.so.0 not from $lib: $loaded" ;;
  esac
}
# The in-tree build's output is the reference: same library code, so the same numbers.
timeout 30 "$bin/basic_training" 5 >"$tmp/reference.out" || fail "$bin/basic_training exited $?"
awk '/^step 1:/ {a=$4} /^step 5:/ {b=$4} END {exit !(a > 0 && b < a)}' "$tmp/reference.out" ||
  { cat "$tmp/reference.out"; fail "the in-tree basic_training's loss did not go down"; }
check_run() { # NAME: runs $tmp/NAME for 5 steps, compares with the reference
  LD_LIBRARY_PATH=$lib timeout 30 "$tmp/$1" 5 >"$tmp/$1.out" 2>&1 ||
    { cat "$tmp/$1.out"; fail "$1 exited $?"; }
  cmp -s "$tmp/$1.out" "$tmp/reference.out" ||
    fail "$1 printed other lines than the in-tree basic_training: $(diff "$tmp/reference.out" "$tmp/$1.out" | head -4 | tr '\n' ' ')"
  echo "$1: $(grep -c '^step' "$tmp/$1.out") steps, loss $(awk '/^step 1:/ {print $4}' "$tmp/$1.out") -> $(awk '/^step 5:/ {print $4}' "$tmp/$1.out"), as in-tree"
}

compile print_version "$src/tests/install/print_version.c" $(pkg-config --cflags --libs ddp)
how=$(links_shared print_version); [ "$how" = yes ] || fail "print_version and libddp.so: $how"
got=$(LD_LIBRARY_PATH=$lib "$tmp/print_version") || fail "print_version exited $?"
[ "$got" = "$version $version" ] ||
  fail "headers and ddp_version() say '$got', not '$version $version' (DDP_VERSION_* in include/ddp/core.h)"

compile pc_shared "$example" $(pkg-config --cflags --libs ddp)
how=$(links_shared pc_shared); [ "$how" = yes ] || fail "pkg-config's build and libddp.so: $how"
check_run pc_shared
# pkg-config --static gives libddp.a's dependencies (Requires.private,
# Libs.private); -l:libddp.a makes the linker take the archive over the .so.
static_libs=()
for w in $(pkg-config --static --libs ddp); do
  [ "$w" = -lddp ] && w=-l:libddp.a
  static_libs+=("$w")
done
compile pc_static "$example" $(pkg-config --cflags ddp) "${static_libs[@]}"
how=$(links_shared pc_static); [ "$how" = no ] || fail "the pkg-config --static build needs libddp.so: $how"
check_run pc_static

"$cmake" -S "$src/tests/install/consumer" -B "$tmp/consumer" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$prefix" -DDDP_EXAMPLE="$example" -DCMAKE_C_COMPILER="$cc" \
  -DCMAKE_C_FLAGS="$san" -DCMAKE_EXE_LINKER_FLAGS="$san" >"$tmp/consumer.log" 2>&1 &&
  "$cmake" --build "$tmp/consumer" >>"$tmp/consumer.log" 2>&1 ||
  { cat "$tmp/consumer.log"; fail "the find_package(ddp) project did not build"; }
grep -q "ddp_VERSION=$version\$" "$tmp/consumer.log" ||
  fail "find_package(ddp) gave $(grep -o 'ddp_VERSION=.*' "$tmp/consumer.log"), not $version"
grep -qx "ddp_DIR:PATH=$lib/cmake/ddp" "$tmp/consumer/CMakeCache.txt" ||
  fail "find_package(ddp) found $(grep '^ddp_DIR' "$tmp/consumer/CMakeCache.txt"), not $lib/cmake/ddp"
mv "$tmp/consumer/example_shared" "$tmp/cmake_shared"
mv "$tmp/consumer/example_static" "$tmp/cmake_static"
how=$(links_shared cmake_shared); [ "$how" = yes ] || fail "ddp::ddp and libddp.so: $how"
how=$(links_shared cmake_static); [ "$how" = no ] || fail "ddp::ddp_static needs libddp.so: $how"
check_run cmake_shared
check_run cmake_static
echo "ok: installed ddp $version builds and runs through pkg-config and find_package(ddp)"
