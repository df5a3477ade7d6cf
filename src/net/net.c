/* Socket helpers: resolve, listen, connect with a deadline, full reads and
 * writes with deadlines, address formatting and splitting. See net.h for the contracts. */
#include "net/net.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "core/core_internal.h"

char *ddp__net_format_addr(const struct sockaddr *addr, socklen_t addr_len, char *buf,
                           size_t buf_bytes) {
  char host[INET6_ADDRSTRLEN] = "?";
  uint16_t port = 0;
  (void)addr_len;
  if (addr->sa_family == AF_INET) {
    const struct sockaddr_in *in = (const struct sockaddr_in *)addr;
    inet_ntop(AF_INET, &in->sin_addr, host, sizeof host);
    port = ntohs(in->sin_port);
    snprintf(buf, buf_bytes, "%s:%u", host, port);
  } else if (addr->sa_family == AF_INET6) {
    const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)addr;
    inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof host);
    port = ntohs(in6->sin6_port);
    snprintf(buf, buf_bytes, "[%s]:%u", host, port);
  } else {
    snprintf(buf, buf_bytes, "(address family %d)", addr->sa_family);
  }
  return buf;
}

char *ddp__net_format_host_port(const char *host, uint16_t port, char *buf, size_t buf_bytes) {
  if (strchr(host, ':')) snprintf(buf, buf_bytes, "[%s]:%u", host, port);
  else snprintf(buf, buf_bytes, "%s:%u", host, port);
  return buf;
}

/* Milliseconds left until deadline for poll(): -1 = forever, 0 = passed. */
static int poll_ms_left(int64_t deadline_ns) {
  if (deadline_ns < 0) return -1;
  int64_t left = deadline_ns - ddp_time_ns();
  if (left <= 0) return 0;
  int64_t ms = (left + 999999) / 1000000;
  return ms > 1000000000 ? 1000000000 : (int)ms;
}

static ddp_status resolve(const char *host, uint16_t port, int passive, struct addrinfo **res) {
  struct addrinfo hints;
  memset(&hints, 0, sizeof hints);
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : AI_ADDRCONFIG;
  if (!passive && host && (!strcmp(host, "127.0.0.1") || !strcmp(host, "::1")))
    hints.ai_flags = 0; /* AI_ADDRCONFIG hides loopback-only machines' addresses */
  char port_text[8];
  snprintf(port_text, sizeof port_text, "%u", port);
  int rc = getaddrinfo(host, port_text, &hints, res);
  if (rc == EAI_ADDRFAMILY || (rc == EAI_NONAME && hints.ai_flags == AI_ADDRCONFIG)) {
    hints.ai_flags = 0;
    rc = getaddrinfo(host, port_text, &hints, res);
  }
  if (rc != 0) {
    char where[DDP_NET_ADDR_BYTES];
    return ddp_error(DDP_ERR_CLOSED, "cannot resolve %s: %s",
                     ddp__net_format_host_port(host ? host : "", port, where, sizeof where),
                     rc == EAI_SYSTEM ? strerror(errno) : gai_strerror(rc));
  }
  return DDP_OK;
}

ddp_status ddp__net_listen(const char *bind_addr, uint16_t port, int backlog, int *fd_out) {
  *fd_out = -1;
  if (!bind_addr || !*bind_addr) bind_addr = "0.0.0.0";
  char where[DDP_NET_ADDR_BYTES];
  ddp__net_format_host_port(bind_addr, port, where, sizeof where);
  struct addrinfo *res = NULL;
  ddp_status st = resolve(bind_addr, port, 1, &res);
  if (st != DDP_OK) return ddp_error_wrap(DDP_ERR_INVALID, "cannot listen on %s", where);
  int fd = -1, err = 0;
  for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
    fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
    if (fd < 0) {
      err = errno;
      continue;
    }
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, backlog) == 0) break;
    err = errno;
    close(fd);
    fd = -1;
  }
  freeaddrinfo(res);
  if (fd < 0) {
    if (err == EADDRINUSE)
      return ddp_error(DDP_ERR_ADDRINUSE,
                       "cannot listen on %s: address already in use (another job or a stale "
                       "process holds it; choose another MASTER_PORT or stop it)",
                       where);
    if (err == EADDRNOTAVAIL)
      return ddp_error(DDP_ERR_INVALID,
                       "cannot listen on %s: address not available (it is not an address of "
                       "this machine)",
                       where);
    return ddp_error(err == EACCES ? DDP_ERR_INVALID : DDP_ERR_SYS, "cannot listen on %s: %s",
                     where, strerror(err));
  }
  *fd_out = fd;
  return DDP_OK;
}

uint16_t ddp__net_local_port(int fd) {
  struct sockaddr_storage ss;
  socklen_t len = sizeof ss;
  if (getsockname(fd, (struct sockaddr *)&ss, &len) != 0) return 0;
  if (ss.ss_family == AF_INET) return ntohs(((struct sockaddr_in *)&ss)->sin_port);
  if (ss.ss_family == AF_INET6) return ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
  return 0;
}

char *ddp__net_local_addr(int fd, char *buf, size_t buf_bytes) {
  struct sockaddr_storage ss;
  socklen_t len = sizeof ss;
  if (getsockname(fd, (struct sockaddr *)&ss, &len) != 0) {
    snprintf(buf, buf_bytes, "?");
    return buf;
  }
  return ddp__net_format_addr((struct sockaddr *)&ss, len, buf, buf_bytes);
}

char *ddp__net_peer_addr(int fd, char *buf, size_t buf_bytes) {
  struct sockaddr_storage ss;
  socklen_t len = sizeof ss;
  if (getpeername(fd, (struct sockaddr *)&ss, &len) != 0) {
    snprintf(buf, buf_bytes, "?");
    return buf;
  }
  return ddp__net_format_addr((struct sockaddr *)&ss, len, buf, buf_bytes);
}

ddp_status ddp__net_set_nonblocking(int fd, int nonblocking) {
  int flags = fcntl(fd, F_GETFL, 0);
  if (flags < 0) return ddp_error(DDP_ERR_SYS, "fcntl(F_GETFL): %s", strerror(errno));
  flags = nonblocking ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK);
  if (fcntl(fd, F_SETFL, flags) < 0)
    return ddp_error(DDP_ERR_SYS, "fcntl(F_SETFL): %s", strerror(errno));
  return DDP_OK;
}

void ddp__net_set_nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

ddp_status ddp__net_wait(int fd, short events, int64_t deadline_ns) {
  struct pollfd p = {.fd = fd, .events = events};
  for (;;) {
    int ms = poll_ms_left(deadline_ns);
    int rc = poll(&p, 1, ms);
    if (rc > 0) return DDP_OK; /* readable, writable, or an error the next call reports */
    if (rc == 0) return ddp_error(DDP_ERR_TIMEOUT, "timed out");
    if (errno != EINTR) return ddp_error(DDP_ERR_SYS, "poll: %s", strerror(errno));
  }
}

/* Non-blocking connect of one address, finished with poll until the deadline. */
static ddp_status connect_one(const struct addrinfo *ai, int64_t deadline_ns, int *fd_out) {
  char where[DDP_NET_ADDR_BYTES];
  ddp__net_format_addr(ai->ai_addr, ai->ai_addrlen, where, sizeof where);
  int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
  if (fd < 0) return ddp_error(DDP_ERR_SYS, "connect to %s: socket: %s", where, strerror(errno));
  int rc;
  do rc = connect(fd, ai->ai_addr, ai->ai_addrlen);
  while (rc != 0 && errno == EINTR);
  int err = rc == 0 ? 0 : errno;
  if (err == EINPROGRESS) {
    ddp_status st = ddp__net_wait(fd, POLLOUT, deadline_ns);
    if (st != DDP_OK) {
      close(fd);
      return ddp_error_wrap(st, "connect to %s", where);
    }
    socklen_t len = sizeof err;
    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
  }
  if (err != 0) {
    close(fd);
    /* Refused, reset, unreachable: the server may just not be up yet. */
    return ddp_error(DDP_ERR_CLOSED, "connect to %s: %s", where, strerror(err));
  }
  ddp_status st = ddp__net_set_nonblocking(fd, 0);
  if (st != DDP_OK) {
    close(fd);
    return st;
  }
  ddp__net_set_nodelay(fd);
  *fd_out = fd;
  return DDP_OK;
}

ddp_status ddp__net_connect(const char *host, uint16_t port, int64_t deadline_ns, int *fd_out) {
  *fd_out = -1;
  struct addrinfo *res = NULL;
  DDP_TRY(resolve(host, port, 0, &res));
  ddp_status st = ddp_error(DDP_ERR_CLOSED, "no address for %s", host);
  for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
    st = connect_one(ai, deadline_ns, fd_out);
    if (st == DDP_OK || st == DDP_ERR_TIMEOUT) break;
  }
  freeaddrinfo(res);
  return st;
}

ddp_status ddp__net_write_full(int fd, const void *buf, size_t len, int64_t deadline_ns) {
  const char *p = buf;
  size_t done = 0;
  while (done < len) {
    ssize_t n = send(fd, p + done, len - done, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      done += (size_t)n;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      ddp_status st = ddp__net_wait(fd, POLLOUT, deadline_ns);
      if (st == DDP_ERR_TIMEOUT)
        return ddp_error(st, "write timed out after %zu of %zu bytes", done, len);
      if (st != DDP_OK) return st;
      continue;
    }
    int err = n < 0 ? errno : EPIPE;
    if (err == EPIPE || err == ECONNRESET || err == ENOTCONN)
      return ddp_error(DDP_ERR_CLOSED,
                       "connection closed by the peer (%s) after %zu of %zu bytes written",
                       strerror(err), done, len);
    return ddp_error(DDP_ERR_IO, "send: %s", strerror(err));
  }
  return DDP_OK;
}

ddp_status ddp__net_read_some(int fd, void *buf, size_t cap, size_t *got, int64_t deadline_ns) {
  *got = 0;
  for (;;) {
    ssize_t n = recv(fd, buf, cap, MSG_DONTWAIT);
    if (n > 0) {
      *got = (size_t)n;
      return DDP_OK;
    }
    if (n == 0) return ddp_error(DDP_ERR_CLOSED, "connection closed by the peer");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      ddp_status st = ddp__net_wait(fd, POLLIN, deadline_ns);
      if (st != DDP_OK) return st;
      continue;
    }
    if (errno == ECONNRESET || errno == ENOTCONN || errno == EPIPE)
      return ddp_error(DDP_ERR_CLOSED, "connection reset by the peer (%s)", strerror(errno));
    return ddp_error(DDP_ERR_IO, "recv: %s", strerror(errno));
  }
}

ddp_status ddp__net_read_full(int fd, void *buf, size_t len, int64_t deadline_ns) {
  char *p = buf;
  size_t done = 0;
  while (done < len) {
    size_t got;
    ddp_status st = ddp__net_read_some(fd, p + done, len - done, &got, deadline_ns);
    if (st == DDP_ERR_TIMEOUT)
      return ddp_error(st, "read timed out after %zu of %zu bytes", done, len);
    if (st == DDP_ERR_CLOSED && done > 0)
      return ddp_error(st, "connection closed by the peer after %zu of %zu bytes", done, len);
    if (st != DDP_OK) return st;
    done += got;
  }
  return DDP_OK;
}

int ddp__net_interface_address(const char *ifname, char *host, size_t cap) {
  struct ifaddrs *ifs = NULL;
  if (getifaddrs(&ifs) != 0) return -1;
  int found = -1;
  for (int want = AF_INET; want != -1 && found != 0; want = want == AF_INET ? AF_INET6 : -1) {
    for (struct ifaddrs *i = ifs; i; i = i->ifa_next) {
      if (!i->ifa_addr || i->ifa_addr->sa_family != want || !(i->ifa_flags & IFF_UP)) continue;
      if (ifname ? strcmp(i->ifa_name, ifname) != 0 : (i->ifa_flags & IFF_LOOPBACK) != 0)
        continue;
      const void *a = want == AF_INET ? (const void *)&((struct sockaddr_in *)i->ifa_addr)->sin_addr
                                      : (const void *)&((struct sockaddr_in6 *)i->ifa_addr)->sin6_addr;
      if (want == AF_INET6 && IN6_IS_ADDR_LINKLOCAL((const struct in6_addr *)a)) continue;
      inet_ntop(want, a, host, (socklen_t)cap);
      found = 0;
      break;
    }
  }
  freeifaddrs(ifs);
  return found;
}

int ddp__net_route_source_address(const char *dest, char *host, size_t cap) {
  struct addrinfo hints, *res = NULL;
  memset(&hints, 0, sizeof hints);
  hints.ai_socktype = SOCK_DGRAM;
  if (getaddrinfo(dest, "9", &hints, &res) != 0) return -1;
  int rc = -1;
  for (struct addrinfo *ai = res; ai && rc != 0; ai = ai->ai_next) {
    int fd = socket(ai->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
        getsockname(fd, (struct sockaddr *)&ss, &len) == 0) {
      const void *a = ss.ss_family == AF_INET
                          ? (const void *)&((struct sockaddr_in *)&ss)->sin_addr
                          : (const void *)&((struct sockaddr_in6 *)&ss)->sin6_addr;
      if (inet_ntop(ss.ss_family, a, host, (socklen_t)cap)) rc = 0;
    }
    close(fd);
  }
  freeaddrinfo(res);
  return rc;
}

int ddp__net_address_host(const char *a, char *host, size_t cap) {
  if (!a || !*a || !strncmp(a, "mem", 3) || !strncmp(a, "file:", 5)) return -1;
  const char *end;
  if (a[0] == '[') {
    a++;
    end = strchr(a, ']');
  } else {
    const char *space = strchr(a, ' ');
    end = space ? space : a + strlen(a);
    while (end > a && end[-1] != ':') end--;
    if (end > a) end--;
  }
  if (!end || end <= a || (size_t)(end - a) >= cap) return -1;
  memcpy(host, a, (size_t)(end - a));
  host[end - a] = '\0';
  return 0;
}

ddp_status ddp__net_split_hostport(const char *what, const char *s, char *host, size_t host_bytes,
                                   int32_t *port) {
  const char *colon;
  const char *h = s;
  size_t hlen;
  if (s[0] == '[') {
    const char *close = strchr(s, ']');
    if (!close || close[1] != ':')
      return ddp_error(DDP_ERR_INVALID, "%s: expected [ipv6]:port", what);
    h = s + 1;
    hlen = (size_t)(close - h);
    colon = close + 1;
  } else {
    colon = strrchr(s, ':');
    if (!colon)
      return ddp_error(DDP_ERR_INVALID, "%s: missing ':port' (expected host:port)", what);
    if (memchr(s, ':', (size_t)(colon - s)))
      return ddp_error(DDP_ERR_INVALID,
                       "%s: more than one ':' (write IPv6 addresses as [addr]:port)", what);
    hlen = (size_t)(colon - s);
  }
  if (hlen == 0) return ddp_error(DDP_ERR_INVALID, "%s: empty host", what);
  if (hlen >= host_bytes)
    return ddp_error(DDP_ERR_INVALID, "%s: host longer than %zu characters", what,
                     host_bytes - 1);
  for (size_t i = 0; i < hlen; i++)
    if (h[i] == '/' || h[i] == '@' || h[i] == '?' || h[i] == '#' || h[i] == ' ' || h[i] == '[')
      return ddp_error(DDP_ERR_INVALID, "%s: character '%c' is not allowed in a host", what,
                       h[i]);
  int64_t p;
  if (ddp__parse_decimal(colon + 1, strlen(colon + 1), 1, 65535, &p) != 0)
    return ddp_error(DDP_ERR_INVALID, "%s: port '%s' is not a number in 1..65535", what,
                     colon + 1);
  memcpy(host, h, hlen);
  host[hlen] = '\0';
  *port = (int32_t)p;
  return DDP_OK;
}

ddp_status ddp__net_choose_address(const char *what, const char *const *explicit_vars, bool one_host,
                                   const char *store_addr, char *host, size_t cap) {
  for (size_t i = 0; explicit_vars && explicit_vars[i]; i++) {
    const char *v = ddp_env_str(explicit_vars[i], NULL);
    if (v) {
      snprintf(host, cap, "%s", v);
      return DDP_OK;
    }
  }
  const char *ifname = ddp_env_str("DDP_SOCKET_IFNAME", NULL);
  if (ifname) {
    if (ddp__net_interface_address(ifname, host, cap) != 0)
      return ddp_error(DDP_ERR_INVALID, "%s: DDP_SOCKET_IFNAME=%s: no such interface with an address that is up",
                       what, ifname);
    return DDP_OK;
  }
  if (one_host) {
    snprintf(host, cap, "127.0.0.1");
    return DDP_OK;
  }
  char shost[256];
  if (ddp__net_address_host(store_addr, shost, sizeof shost) == 0 &&
      ddp__net_route_source_address(shost, host, cap) == 0)
    return DDP_OK;
  if (ddp__net_interface_address(NULL, host, cap) == 0) return DDP_OK;
  snprintf(host, cap, "127.0.0.1");
  return DDP_OK;
}
