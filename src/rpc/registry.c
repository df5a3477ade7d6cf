/* ddp's one registry of names (rpc_internal.h, "Named tables"), and on it
 * the process-wide table of functions callable by RPC: user functions
 * (ddp_rpc_register) and ddp's built-in "__" ones. */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "rpc/registry.h"
#include "rpc/rpc_internal.h"

struct ddp__name_entry {
  char name[DDP_RPC_MAX_NAME_BYTES];
  void *value;
  void *user;
};

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

/* The entry of name, or NULL; under t->mu. */
static ddp__name_entry *find(ddp__name_table *t, const char *name) {
  for (size_t i = 0; i < t->n; i++)
    if (strcmp(t->entries[i].name, name) == 0) return &t->entries[i];
  return NULL;
}

ddp_status ddp__name_table_set(ddp__name_table *t, const char *name, void *value, void *user, bool replace) {
  DDP_TRY(ddp__rpc_check_name(t->what, name));
  if (!value) return ddp_error(DDP_ERR_INVALID, "register %s '%s': NULL", t->what, name);
  pthread_mutex_lock(&t->mu);
  ddp__name_entry *e = find(t, name);
  if (e && !replace) {
    pthread_mutex_unlock(&t->mu);
    return ddp_error(DDP_ERR_STATE, "%s '%s' exists already in this process", t->what, name);
  }
  if (!e && t->n == t->cap) {
    size_t cap = t->cap ? t->cap * 2 : 16;
    ddp__name_entry *grown = ddp_calloc(cap, sizeof *grown);
    if (!grown) {
      pthread_mutex_unlock(&t->mu);
      return ddp_error(DDP_ERR_NOMEM, "register %s '%s': out of memory", t->what, name);
    }
    if (t->n) memcpy(grown, t->entries, t->n * sizeof *grown);
    ddp_free(t->entries);
    t->entries = grown;
    t->cap = cap;
  }
  if (!e) {
    e = &t->entries[t->n++];
    snprintf(e->name, sizeof e->name, "%s", name);
  }
  e->value = value;
  e->user = user;
  pthread_mutex_unlock(&t->mu);
  return DDP_OK;
}

bool ddp__name_table_get(ddp__name_table *t, const char *name, void **value, void **user) {
  pthread_mutex_lock(&t->mu);
  ddp__name_entry *e = name ? find(t, name) : NULL;
  if (e) {
    *value = e->value;
    if (user) *user = e->user;
  }
  pthread_mutex_unlock(&t->mu);
  return e != NULL;
}

ddp_status ddp__name_table_remove(ddp__name_table *t, const char *name) {
  pthread_mutex_lock(&t->mu);
  ddp__name_entry *e = name ? find(t, name) : NULL;
  if (e) *e = t->entries[--t->n];
  pthread_mutex_unlock(&t->mu);
  if (!e) return ddp_error(DDP_ERR_NOTFOUND, "no %s '%s' is registered", t->what, name ? name : "(null)");
  return DDP_OK;
}

void ddp__name_table_remove_value(ddp__name_table *t, const void *value) {
  pthread_mutex_lock(&t->mu);
  for (size_t i = 0; i < t->n;) {
    if (t->entries[i].value == value) t->entries[i] = t->entries[--t->n];
    else i++;
  }
  pthread_mutex_unlock(&t->mu);
}

void ddp__name_table_names(ddp__name_table *t, char *buf, size_t bytes) {
  size_t used = 0, shown = 0;
  buf[0] = '\0';
  pthread_mutex_lock(&t->mu);
  for (size_t i = 0; i < t->n && used + 1 < bytes; i++) {
    if (t->entries[i].name[0] == '_' && t->entries[i].name[1] == '_') continue;
    int n = snprintf(buf + used, bytes - used, "%s%s", shown ? ", " : "", t->entries[i].name);
    if (n < 0 || (size_t)n >= bytes - used) {
      snprintf(buf + used, bytes - used, ", ...");
      break;
    }
    used += (size_t)n;
    shown++;
  }
  pthread_mutex_unlock(&t->mu);
  if (!shown) snprintf(buf, bytes, "none");
}

/* ---- RPC's functions ------------------------------------------------------- */

static ddp__name_table functions = DDP__NAME_TABLE_INIT("function");

ddp_status ddp_rpc_register(const char *name, ddp_rpc_handler fn, void *user) {
  if (name && name[0] == '_' && name[1] == '_')
    return ddp_error(DDP_ERR_INVALID,
                     "rpc register '%s': names starting with \"__\" are reserved for ddp", name);
  return ddp__name_table_set(&functions, name, (void *)fn, user, true);
}

ddp_status ddp__rpc_register_builtin(const char *name, ddp_rpc_handler fn, void *user) {
  DDP_ASSERT(name && name[0] == '_' && name[1] == '_');
  return ddp__name_table_set(&functions, name, (void *)fn, user, true);
}

ddp_status ddp_rpc_unregister(const char *name) {
  if (ddp__name_table_remove(&functions, name) != DDP_OK)
    return ddp_error(DDP_ERR_NOTFOUND, "rpc unregister '%s': no such function", name ? name : "(null)");
  return DDP_OK;
}

bool ddp__rpc_lookup(const char *name, ddp_rpc_handler *fn, void **user) {
  void *value;
  if (!ddp__name_table_get(&functions, name, &value, user)) return false;
  *fn = (ddp_rpc_handler)value;
  return true;
}

void ddp__rpc_registered_names(char *buf, size_t bytes) { ddp__name_table_names(&functions, buf, bytes); }
