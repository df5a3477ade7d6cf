/* ddp net: socket helpers shared by the store and the TCP transport --
 * resolving, listening, connecting with a deadline, full reads and writes
 * with deadlines (EINTR, short transfers), address formatting and
 * splitting, host identity. net's one internal header for the layers above
 * (it has no public one). A leaf layer:
 * it depends on core only. Errors are ddp_status with a message naming the
 * address ("connect to 10.0.0.1:29500: connection refused"). */
#ifndef DDP_NET_NET_H
#define DDP_NET_NET_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "ddp/core.h"

/* Long enough for "[ffff:...:ffff%ifname]:65535". */
#define DDP_NET_ADDR_BYTES 96

/* Formats a socket address as "1.2.3.4:5" or "[::1]:5" into buf. Returns buf. */
char *ddp__net_format_addr(const struct sockaddr *addr, socklen_t addr_len, char *buf,
                           size_t buf_bytes);
/* Formats host and port the same way ("[::1]:5" when host contains ':'). */
char *ddp__net_format_host_port(const char *host, uint16_t port, char *buf, size_t buf_bytes);

/* Splits "host:port" or "[v6]:port" into host (without brackets; host_bytes
 * including the terminator) and port (1..65535). `what` names the value in
 * errors ("DDP_STORE_ADDR"): DDP_ERR_INVALID saying what is wrong. */
ddp_status ddp__net_split_hostport(const char *what, const char *s, char *host, size_t host_bytes,
                                   int32_t *port);

/* This host's identity: "<hostname>/<network namespace inode>" (or
 * DDP_HOST_ID when set; DDP_ERR_INVALID when that is too long for `bytes` or
 * holds whitespace). Two processes with the same identity can reach each
 * other's shared memory and loopback (hostid.c). */
ddp_status ddp__net_host_id(char *out, size_t bytes);

/* Creates a listening TCP socket on bind_addr:port (NULL/"" -> 0.0.0.0; port 0
 * picks a free one) with SO_REUSEADDR, close-on-exec, non-blocking, and the
 * given backlog. *fd_out is owned by the caller. EADDRINUSE becomes
 * DDP_ERR_ADDRINUSE with advice on what to do. */
ddp_status ddp__net_listen(const char *bind_addr, uint16_t port, int backlog, int *fd_out);

/* One connection attempt to host:port (trying each resolved address) that
 * gives up at deadline_ns (ddp_time_ns clock). The socket returned is
 * blocking, close-on-exec, TCP_NODELAY. Refused / unreachable / unresolved
 * map to DDP_ERR_CLOSED (worth retrying); the deadline to DDP_ERR_TIMEOUT. */
ddp_status ddp__net_connect(const char *host, uint16_t port, int64_t deadline_ns, int *fd_out);

/* The locally bound port of a socket, 0 on error. */
uint16_t ddp__net_local_port(int fd);
/* The locally bound address of a socket as text. */
char *ddp__net_local_addr(int fd, char *buf, size_t buf_bytes);
/* The peer's address as text ("?" on error). */
char *ddp__net_peer_addr(int fd, char *buf, size_t buf_bytes);

ddp_status ddp__net_set_nonblocking(int fd, int nonblocking);
void ddp__net_set_nodelay(int fd);

/* Writes all len bytes, waiting with poll when the socket is full, until
 * deadline_ns (< 0: no deadline). Handles EINTR and short writes; never
 * raises SIGPIPE. DDP_ERR_CLOSED when the peer is gone, DDP_ERR_TIMEOUT at
 * the deadline; the message says how many bytes were written. */
ddp_status ddp__net_write_full(int fd, const void *buf, size_t len, int64_t deadline_ns);

/* Reads exactly len bytes (see write_full). DDP_ERR_CLOSED on end of file
 * before len bytes; the message says how many had arrived. */
ddp_status ddp__net_read_full(int fd, void *buf, size_t len, int64_t deadline_ns);

/* Reads what is available, at least 1 byte, at most cap; waits until then.
 * *got = bytes read. Same errors as read_full. */
ddp_status ddp__net_read_some(int fd, void *buf, size_t cap, size_t *got, int64_t deadline_ns);

/* Waits until fd is readable (events = POLLIN) or writable (POLLOUT) or the
 * deadline passes (DDP_ERR_TIMEOUT). Handles EINTR. */
ddp_status ddp__net_wait(int fd, short events, int64_t deadline_ns);

/* The first address (IPv4 preferred, link-local IPv6 skipped) of interface
 * `ifname` that is up, or of any non-loopback interface when ifname is NULL,
 * as text into host. 0 when found, -1 otherwise. */
int ddp__net_interface_address(const char *ifname, char *host, size_t cap);

/* The source address the kernel would use to reach `dest` (a name or
 * literal): connects a UDP socket (sends nothing) and reads its local
 * address. 0 when found, -1 otherwise. */
int ddp__net_route_source_address(const char *dest, char *host, size_t cap);
/* The host part of a store's address as ddp_store_address gives it
 * ("10.0.0.1:29500 prefix \"g/\"" -> "10.0.0.1", "[::1]:5" -> "::1"); -1 for
 * NULL and stores without one (mem, file:). 0 when found. */
int ddp__net_address_host(const char *address, char *host, size_t cap);

/* The address a process publishes for its peers to connect to (the tcp
 * backend's pairs, the rpc agent), in order of preference: the first set
 * variable of `explicit_vars` (NULL-terminated: {"DDP_COMM_ADDR", NULL});
 * the first address of DDP_SOCKET_IFNAME (DDP_ERR_INVALID, the message
 * starting with `what`, when it has none that is up); 127.0.0.1 when
 * `one_host` (every peer runs on this host); the source address of the route
 * to the store's host (store_addr as ddp_store_address gives it, NULL ok:
 * the interface that faces the peers, since they reach the same store); the
 * first non-loopback address; 127.0.0.1. */
ddp_status ddp__net_choose_address(const char *what, const char *const *explicit_vars, bool one_host,
                                   const char *store_addr, char *host, size_t cap);

#endif /* DDP_NET_NET_H */
