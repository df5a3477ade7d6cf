/* The process-wide table of functions callable by RPC, by name: user
 * functions (ddp_rpc_register) and ddp's built-in "__" ones. */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "rpc/registry.h"

typedef struct entry {
  char name[DDP_RPC_MAX_NAME_BYTES];
  ddp_rpc_handler fn;
  void *user;
} entry;

static pthread_mutex_t registry_mu = PTHREAD_MUTEX_INITIALIZER;
static entry *entries;
static size_t num_entries, cap_entries;

ddp_status ddp__rpc_check_name(const char *what, const char *name) {
  if (!name || !*name) return ddp_error(DDP_ERR_INVALID, "%s name is empty", what);
  size_t n = strlen(name);
  if (n >= DDP_RPC_MAX_NAME_BYTES)
    return ddp_error(DDP_ERR_INVALID, "%s name '%.40s...' is %zu bytes long (at most %d)", what,
                     name, n, DDP_RPC_MAX_NAME_BYTES - 1);
  for (const char *p = name; *p; p++) {
    char c = *p;
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
          c == '_' || c == '.' || c == ':' || c == '-'))
      return ddp_error(DDP_ERR_INVALID,
                       "%s name '%s' has the character '%c' (allowed: letters, digits, _ . : -)",
                       what, name, c);
  }
  return DDP_OK;
}

static ddp_status add(const char *name, ddp_rpc_handler fn, void *user) {
  DDP_TRY(ddp__rpc_check_name("function", name));
  if (!fn) return ddp_error(DDP_ERR_INVALID, "rpc register '%s': the handler is NULL", name);
  pthread_mutex_lock(&registry_mu);
  for (size_t i = 0; i < num_entries; i++)
    if (strcmp(entries[i].name, name) == 0) {
      entries[i].fn = fn;
      entries[i].user = user;
      pthread_mutex_unlock(&registry_mu);
      return DDP_OK;
    }
  if (num_entries == cap_entries) {
    size_t cap = cap_entries ? cap_entries * 2 : 16;
    entry *grown = ddp_calloc(cap, sizeof *grown);
    if (!grown) {
      pthread_mutex_unlock(&registry_mu);
      return ddp_error(DDP_ERR_NOMEM, "rpc register '%s': out of memory", name);
    }
    if (num_entries) memcpy(grown, entries, num_entries * sizeof *grown);
    ddp_free(entries);
    entries = grown;
    cap_entries = cap;
  }
  entry *e = &entries[num_entries++];
  snprintf(e->name, sizeof e->name, "%s", name);
  e->fn = fn;
  e->user = user;
  pthread_mutex_unlock(&registry_mu);
  return DDP_OK;
}

ddp_status ddp_rpc_register(const char *name, ddp_rpc_handler fn, void *user) {
  if (name && name[0] == '_' && name[1] == '_')
    return ddp_error(DDP_ERR_INVALID,
                     "rpc register '%s': names starting with \"__\" are reserved for ddp", name);
  return add(name, fn, user);
}

ddp_status ddp__rpc_register_builtin(const char *name, ddp_rpc_handler fn, void *user) {
  DDP_ASSERT(name && name[0] == '_' && name[1] == '_');
  return add(name, fn, user);
}

ddp_status ddp_rpc_unregister(const char *name) {
  pthread_mutex_lock(&registry_mu);
  for (size_t i = 0; name && i < num_entries; i++)
    if (strcmp(entries[i].name, name) == 0) {
      entries[i] = entries[--num_entries];
      pthread_mutex_unlock(&registry_mu);
      return DDP_OK;
    }
  pthread_mutex_unlock(&registry_mu);
  return ddp_error(DDP_ERR_NOTFOUND, "rpc unregister '%s': no such function",
                   name ? name : "(null)");
}

bool ddp__rpc_lookup(const char *name, ddp_rpc_handler *fn, void **user) {
  pthread_mutex_lock(&registry_mu);
  for (size_t i = 0; i < num_entries; i++)
    if (strcmp(entries[i].name, name) == 0) {
      *fn = entries[i].fn;
      *user = entries[i].user;
      pthread_mutex_unlock(&registry_mu);
      return true;
    }
  pthread_mutex_unlock(&registry_mu);
  return false;
}

void ddp__rpc_registered_names(char *buf, size_t bytes) {
  size_t used = 0;
  buf[0] = '\0';
  pthread_mutex_lock(&registry_mu);
  size_t shown = 0;
  for (size_t i = 0; i < num_entries && used + 1 < bytes; i++) {
    if (entries[i].name[0] == '_' && entries[i].name[1] == '_') continue;
    int n = snprintf(buf + used, bytes - used, "%s%s", shown ? ", " : "", entries[i].name);
    if (n < 0 || (size_t)n >= bytes - used) {
      snprintf(buf + used, bytes - used, ", ...");
      break;
    }
    used += (size_t)n;
    shown++;
  }
  pthread_mutex_unlock(&registry_mu);
  if (!shown) snprintf(buf, bytes, "none");
}
