# Sourced by the network-namespace tests (after they define skip, fail and
# tmp): two "hosts" on one machine, network namespaces joined by a veth pair,
# both ends shaped with tbf.
#
# netns_pair_up TAG SUBNET RATE_MBIT creates namespaces ${TAG}A<pid> and
# ${TAG}B<pid> (TAG lower case; the veth ends are ${TAG}a<pid> and
# ${TAG}b<pid>), addresses SUBNET.1/24 in A and SUBNET.2/24 in B, and sets
# nsA, nsB, vA, vB. Names carry this shell's pid, so parallel runs do not
# collide; a run killed outright (SIGKILL, e.g. by a test timeout) cannot
# clean up, so namespaces of TAG whose shell is gone are removed first.
# Skips (exit 77) where namespaces, veth or tbf are unavailable.
# netns_pair_down removes them (call it from the test's EXIT trap; deleting a
# namespace removes its veth end).
netns_pair_up() {
  local tag=$1 subnet=$2 rate_mbit=$3 ns pair
  nsA=${tag}A$$ nsB=${tag}B$$ vA=${tag}a$$ vB=${tag}b$$
  for ns in $(ip netns list 2>/dev/null | sed -n "s/^\(${tag}[AB]\([0-9][0-9]*\)\)\b.*/\1/p"); do
    kill -0 "${ns#"${tag}"?}" 2>/dev/null || ip netns del "$ns" 2>/dev/null
  done
  ip netns add "$nsA" 2>"$tmp/err" || skip "ip netns add failed: $(cat "$tmp/err")"
  ip netns add "$nsB" || fail "ip netns add $nsB"
  ip link add "$vA" type veth peer name "$vB" || skip "cannot create a veth pair"
  ip link set "$vA" netns "$nsA" && ip link set "$vB" netns "$nsB" || fail "moving the veth ends"
  ip -n "$nsA" addr add "$subnet.1/24" dev "$vA" && ip -n "$nsB" addr add "$subnet.2/24" dev "$vB" ||
    fail "addresses"
  for ns in "$nsA" "$nsB"; do ip -n "$ns" link set lo up || fail "lo up in $ns"; done
  ip -n "$nsA" link set "$vA" up && ip -n "$nsB" link set "$vB" up || fail "veth up"
  # RATE_MBIT each way. The bucket holds a few 64 KiB GSO packets (smaller
  # would split them and cost CPU, not rate); 20 ms of queue.
  for pair in "$nsA:$vA" "$nsB:$vB"; do
    ip netns exec "${pair%%:*}" tc qdisc add dev "${pair##*:}" root tbf rate "${rate_mbit}mbit" \
      burst 256kb latency 20ms 2>"$tmp/err" || skip "tc tbf unavailable: $(cat "$tmp/err")"
  done
}

netns_pair_down() {
  [ -n "${nsA:-}" ] || return 0
  ip netns del "$nsA" 2>/dev/null
  ip netns del "$nsB" 2>/dev/null
  ip link del "$vA" 2>/dev/null
}
