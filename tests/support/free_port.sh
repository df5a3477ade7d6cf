# Sourced by shell tests: ddp_free_port prints a TCP port nobody listens on,
# for MASTER_PORT-style variables that a rank binds later. It picks from
# 10000-31999, below Linux's ephemeral range (32768-60999,
# /proc/sys/net/ipv4/ip_local_port_range), so the kernel never hands the port
# to another test's connect() or bind(0) between the check and the bind
# (a test_ddp_train_dp run failed that way in CI: "address already in use").
ddp_free_port() {
  local p
  for _ in $(seq 1 100); do
    p=$((10000 + (RANDOM * 32768 + RANDOM) % 22000))
    ss -Htln "sport = :$p" | grep -q . || { echo "$p"; return 0; }
  done
  return 1
}
