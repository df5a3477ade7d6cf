/* rendezvous parsing: init URLs, Slurm hostlists and tasks-per-node lists,
 * rank-range formatting and host identity, each against a table of inputs
 * with the exact result or the error text expected. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <cmocka.h>

#include "core/core_internal.h"
#include "net/net.h"
#include "rendezvous/rdzv_internal.h"

/* ---- URLs ----------------------------------------------------------------- */

typedef struct url_case {
  const char *url;
  ddp_status status;
  const char *error;  /* substring of the message, when status != OK */
  ddp__rdzv_scheme scheme;
  const char *host_or_path;
  int32_t port, rank, world_size;
} url_case;

#define ERR(url, message) {url, DDP_ERR_INVALID, message, DDP__RDZV_ENV, NULL, 0, 0, 0}
static const url_case url_cases[] = {
    {NULL, DDP_OK, NULL, DDP__RDZV_ENV, "", 0, -1, -1},
    {"", DDP_OK, NULL, DDP__RDZV_ENV, "", 0, -1, -1},
    {"env://", DDP_OK, NULL, DDP__RDZV_ENV, "", 0, -1, -1},
    {"env://?rank=2&world_size=4", DDP_OK, NULL, DDP__RDZV_ENV, "", 0, 2, 4},
    {"tcp://127.0.0.1:29500", DDP_OK, NULL, DDP__RDZV_TCP, "127.0.0.1", 29500, -1, -1},
    {"tcp://localhost:1/", DDP_OK, NULL, DDP__RDZV_TCP, "localhost", 1, -1, -1},
    {"tcp://node01.cluster:65535?rank=0&world_size=1", DDP_OK, NULL, DDP__RDZV_TCP,
     "node01.cluster", 65535, 0, 1},
    {"tcp://[::1]:29500?world_size=8&rank=7", DDP_OK, NULL, DDP__RDZV_TCP, "::1", 29500, 7, 8},
    {"file:///tmp/ddp/rdzv", DDP_OK, NULL, DDP__RDZV_FILE, "/tmp/ddp/rdzv", 0, -1, -1},
    {"file:///shared/job 1?rank=1&world_size=2", DDP_OK, NULL, DDP__RDZV_FILE, "/shared/job 1", 0,
     1, 2},
    /* Errors: every message quotes the URL. */
    ERR("tpc://x",
     "init url 'tpc://x': unknown scheme 'tpc' (expected env://, tcp:// or file://)"),
    ERR("localhost:29500", "init url 'localhost:29500': missing scheme"),
    ERR("ENV://", "unknown scheme 'ENV'"),
    ERR("env://host:1", "env:// takes no host or path"),
    ERR("tcp://", "tcp:// needs host:port"),
    ERR("tcp://localhost", "init url 'tcp://localhost': missing ':port'"),
    ERR("tcp://localhost:", "port '' is not a number in 1..65535"),
    ERR("tcp://localhost:0", "port '0' is not a number in 1..65535"),
    ERR("tcp://localhost:65536", "port '65536' is not a number"),
    ERR("tcp://localhost:29x", "port '29x'"),
    ERR("tcp://:29500", "empty host"),
    ERR("tcp://::1:29500", "write IPv6 addresses as [addr]:port"),
    ERR("tcp://[::1]29500", "expected [ipv6]:port"),
    ERR("tcp://h:1/path", "tcp:// takes host:port and no path"),
    ERR("tcp://user@h:1", "user names ('@') are not supported"),
    ERR("tcp://h:1#frag", "fragments ('#') are not allowed"),
    ERR("tcp://h:1?rank=1&rank=1", "'rank' is given twice"),
    ERR("tcp://h:1?rank=-1", "rank='-1' is not an integer >= 0"),
    ERR("tcp://h:1?world_size=0", "world_size='0' is not an integer >= 1"),
    ERR("tcp://h:1?world_size=", "world_size='' is not an integer"),
    ERR("tcp://h:1?rank", "query item 'rank' is not key=value"),
    ERR("tcp://h:1?size=2",
     "unknown query parameter 'size' (expected rank and world_size)"),
    ERR("tcp://h:1?rank=1&", "query ends with '&'"),
    ERR("file://relative/path", "write file:///absolute/path"),
    ERR("file://host/tmp/x", "takes no host"),
    ERR("file:///", "names a directory"),
    ERR("file:///tmp/dir/", "names a directory"),
};

static void test_url_table(void **state) {
  (void)state;
  for (size_t i = 0; i < sizeof url_cases / sizeof url_cases[0]; i++) {
    const url_case *c = &url_cases[i];
    ddp__rdzv_url u;
    ddp_clear_error();
    ddp_status s = ddp__rdzv_url_parse(c->url, &u);
    if (s != c->status || (s && !strstr(ddp_last_error(), c->error)))
      fail_msg("url '%s': status %d (%s), expected %d with '%s'", c->url ? c->url : "(null)", s,
               ddp_last_error(), c->status, c->error ? c->error : "");
    if (s) continue;
    assert_int_equal(u.scheme, c->scheme);
    if (c->scheme == DDP__RDZV_TCP) assert_string_equal(u.host, c->host_or_path);
    if (c->scheme == DDP__RDZV_FILE) assert_string_equal(u.path, c->host_or_path);
    assert_int_equal(u.port, c->port);
    assert_int_equal(u.rank, c->rank);
    assert_int_equal(u.world_size, c->world_size);
  }
}

/* ---- Hostlists ------------------------------------------------------------ */

typedef struct hostlist_case {
  const char *list;
  const char *expanded; /* hosts joined by ' ', or the error substring */
  ddp_status status;
} hostlist_case;

static const hostlist_case hostlist_cases[] = {
    {"node01", "node01", DDP_OK},
    {"node[01-04,07]", "node01 node02 node03 node04 node07", DDP_OK},
    {"a1,b[2-3]", "a1 b2 b3", DDP_OK},
    {"node[8-11]", "node8 node9 node10 node11", DDP_OK},
    {"node[08-11]", "node08 node09 node10 node11", DDP_OK},
    {"n[001-003]", "n001 n002 n003", DDP_OK},
    {"rack[1-2]-node[1-2]", "rack1-node1 rack1-node2 rack2-node1 rack2-node2", DDP_OK},
    {"gpu[1,3]-ib,login", "gpu1-ib gpu3-ib login", DDP_OK},
    {"[1-2]x", "1x 2x", DDP_OK},
    {"c[5]", "c5", DDP_OK},
    {"h.example.org,h-2_b", "h.example.org h-2_b", DDP_OK},
    {"x[0-0],y[00-01]", "x0 y00 y01", DDP_OK},
    /* Malformed lists: the message says what and where. */
    {"", "hostlist is empty", DDP_ERR_INVALID},
    {"node[01-04", "hostlist 'node[01-04': unclosed '[' at offset 10", DDP_ERR_INVALID},
    {"node01-04]", "']' without '[' at offset 9", DDP_ERR_INVALID},
    {"node[04-01]", "descending range 4-1 at offset 8", DDP_ERR_INVALID},
    {"node[a-b]", "expected a number in brackets at offset 5", DDP_ERR_INVALID},
    {"node[]", "expected a number in brackets at offset 5", DDP_ERR_INVALID},
    {"node[1-]", "expected a number in brackets at offset 7", DDP_ERR_INVALID},
    {"node[1[2]]", "nested '[' at offset 6", DDP_ERR_INVALID},
    {"node[1;2]", "expected ',', '-' or ']' in brackets at offset 6", DDP_ERR_INVALID},
    {"a,,b", "empty host name at offset 2", DDP_ERR_INVALID},
    {"a,b,", "trailing ','", DDP_ERR_INVALID},
    {",a", "empty host name at offset 0", DDP_ERR_INVALID},
    {"a b", "unexpected character ' ' at offset 1", DDP_ERR_INVALID},
    {"n[1-9999999]", "more than 1048576 hosts", DDP_ERR_RANGE},
    {"a[1-1024]b[1-1025]", "more than 1048576 hosts", DDP_ERR_RANGE},
    {"n[1234567890123456789]", "number too long", DDP_ERR_INVALID},
};

static void test_hostlist_table(void **state) {
  (void)state;
  for (size_t i = 0; i < sizeof hostlist_cases / sizeof hostlist_cases[0]; i++) {
    const hostlist_case *c = &hostlist_cases[i];
    char **hosts = (char **)1;
    size_t count = 99;
    ddp_clear_error();
    ddp_status s = ddp_hostlist_expand(c->list, &hosts, &count);
    if (s != c->status) fail_msg("hostlist '%s': status %d (%s)", c->list, s, ddp_last_error());
    if (s) {
      if (!strstr(ddp_last_error(), c->expanded))
        fail_msg("hostlist '%s': error '%s', expected '%s'", c->list, ddp_last_error(), c->expanded);
      assert_null(hosts);
      assert_int_equal(count, 0);
      continue;
    }
    char joined[512] = "";
    for (size_t h = 0; h < count; h++) {
      if (h) strcat(joined, " ");
      strcat(joined, hosts[h]);
    }
    if (strcmp(joined, c->expanded) != 0)
      fail_msg("hostlist '%s' -> '%s', expected '%s'", c->list, joined, c->expanded);
    ddp_free(hosts); /* one block */
  }
}

static void test_hostlist_large(void **state) {
  (void)state;
  char **hosts;
  size_t count;
  assert_int_equal(ddp_hostlist_expand("n[0000-9999],m[1-2]", &hosts, &count), DDP_OK);
  assert_int_equal(count, 10002);
  assert_string_equal(hosts[0], "n0000");
  assert_string_equal(hosts[4321], "n4321");
  assert_string_equal(hosts[9999], "n9999");
  assert_string_equal(hosts[10001], "m2");
  ddp_free(hosts);
}

/* ---- Slurm tasks per node ------------------------------------------------ */

static void test_tasks_per_node(void **state) {
  (void)state;
  static const struct {
    const char *list;
    int node;
    int32_t expect; /* < 0: error expected, message contains err */
    const char *err;
  } cases[] = {
      {"4", 0, 4, NULL},
      {"2(x3),1", 0, 2, NULL},
      {"2(x3),1", 2, 2, NULL},
      {"2(x3),1", 3, 1, NULL},
      {"1,2,3", 1, 2, NULL},
      {"8(x2)", 1, 8, NULL},
      {"2(x3),1", 4, -1, "covers 4 nodes; node 4 is not in it"},
      {"", 0, -1, "empty"},
      {"2(3)", 0, -1, "expected '(xN)' at offset 1"},
      {"2(x3", 0, -1, "expected '(xN)'"},
      {"0", 0, -1, "expected a positive count at offset 0"},
      {"2,x", 1, -1, "expected a positive count at offset 2"},
      {"2;3", 1, -1, "unexpected ';' at offset 1"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    int32_t got = -7;
    ddp_status s = ddp__slurm_tasks_per_node(cases[i].list, cases[i].node, &got);
    if (cases[i].expect >= 0) {
      if (s != DDP_OK || got != cases[i].expect)
        fail_msg("'%s' node %d: status %d (%s), got %d, expected %d", cases[i].list, cases[i].node,
                 s, ddp_last_error(), got, cases[i].expect);
    } else if (s == DDP_OK || !strstr(ddp_last_error(), cases[i].err)) {
      fail_msg("'%s' node %d: status %d, error '%s', expected '%s'", cases[i].list, cases[i].node, s,
               ddp_last_error(), cases[i].err);
    }
  }
}

/* ---- Formatting rank lists ------------------------------------------------ */

static void test_format_ranks(void **state) {
  (void)state;
  char out[256];
  int32_t a[] = {2};
  ddp__format_ranks(a, 1, 32, out, sizeof out);
  assert_string_equal(out, "2");
  int32_t b[] = {0, 1, 2, 5, 7, 8, 9, 12};
  ddp__format_ranks(b, 8, 32, out, sizeof out);
  assert_string_equal(out, "0-2, 5, 7-9, 12");
  ddp__format_ranks(b, 8, 2, out, sizeof out);
  assert_string_equal(out, "0-2, 5, ... (4 more)");
  ddp__format_ranks(b, 0, 32, out, sizeof out);
  assert_string_equal(out, "");
  char tiny[6];
  ddp__format_ranks(b, 8, 32, tiny, sizeof tiny); /* truncates, stays a string */
  assert_true(strlen(tiny) < sizeof tiny);
}

/* ---- Host identity -------------------------------------------------------- */

static void test_host_id(void **state) {
  (void)state;
  char id[DDP_RENDEZVOUS_HOST_ID_BYTES];
  unsetenv("DDP_HOST_ID");
  assert_int_equal(ddp__net_host_id(id, sizeof id), DDP_OK);
  char host[256];
  assert_int_equal(gethostname(host, sizeof host), 0);
  assert_int_equal(strncmp(id, host, strlen(host)), 0);
  struct stat st;
  if (stat("/proc/self/ns/net", &st) == 0) {
    char expect[400];
    snprintf(expect, sizeof expect, "%s/%llu", host, (unsigned long long)st.st_ino);
    assert_string_equal(id, expect);
  }
  setenv("DDP_HOST_ID", "rackA-7", 1);
  assert_int_equal(ddp__net_host_id(id, sizeof id), DDP_OK);
  assert_string_equal(id, "rackA-7");
  setenv("DDP_HOST_ID", "has space", 1);
  assert_int_equal(ddp__net_host_id(id, sizeof id), DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "DDP_HOST_ID=\"has space\""));
  unsetenv("DDP_HOST_ID");
}

static void test_source_names(void **state) {
  (void)state;
  assert_string_equal(ddp_rendezvous_source_name(DDP_RENDEZVOUS_SOURCE_ENV), "env");
  assert_string_equal(ddp_rendezvous_source_name(DDP_RENDEZVOUS_SOURCE_SLURM), "slurm");
  assert_string_equal(ddp_rendezvous_source_name(DDP_RENDEZVOUS_SOURCE_MPI), "mpi");
  assert_string_equal(ddp_rendezvous_source_name(DDP_RENDEZVOUS_SOURCE_URL), "url");
  assert_string_equal(ddp_rendezvous_source_name(DDP_RENDEZVOUS_SOURCE_HOSTS), "hosts");
  assert_string_equal(ddp_rendezvous_source_name((ddp_rendezvous_source)99), "unknown");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_url_table),      cmocka_unit_test(test_hostlist_table),
      cmocka_unit_test(test_hostlist_large), cmocka_unit_test(test_tasks_per_node),
      cmocka_unit_test(test_format_ranks),   cmocka_unit_test(test_host_id),
      cmocka_unit_test(test_source_names),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
