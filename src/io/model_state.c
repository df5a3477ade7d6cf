/* A model's state dict as a safetensors file: save, and load_state_dict
 * (strict) with every check done before the first byte is copied. */
#include <stdio.h>
#include <string.h>

#include "io/io_internal.h"
#include "io/model_state.h"
#include "nn/module.h" /* ddp__model_state_entry_any: a model on a GPU */

/* "[16, 1, 5, 5]" */
static void shape_str(int ndim, const int64_t *shape, char *buf, size_t n) {
  size_t k = (size_t)snprintf(buf, n, "[");
  for (int d = 0; d < ndim && k < n; d++)
    k += (size_t)snprintf(buf + k, n - k, "%s%lld", d ? ", " : "", (long long)shape[d]);
  if (k < n) snprintf(buf + k, n - k, "]");
}

ddp_status ddp__model_state_entries(const ddp_model *model, ddp_safetensors_entry **out,
                                    int *count) {
  int n = ddp_model_state_count(model);
  /* A model on a GPU: its parameters and buffers are copied to host memory
   * after the entries, in the same allocation (the same file as from the
   * CPU; docs/cuda.md, "Memory"). */
  size_t head = ((n ? (size_t)n : 1) * sizeof(ddp_safetensors_entry) + 63) & ~(size_t)63;
  size_t host_bytes = 0;
  for (int i = 0; i < n; i++) {
    ddp_state_entry s;
    bool dev;
    DDP_TRY(ddp__model_state_entry_any(model, i, &s, &dev));
    if (dev) host_bytes += ((size_t)s.numel * ddp_dtype_size(s.dtype) + 63) & ~(size_t)63;
  }
  ddp_safetensors_entry *e = ddp_calloc(1, head + host_bytes);
  if (!e) return ddp_error(DDP_ERR_NOMEM, "checkpoint: cannot allocate %d entries", n);
  char *host = (char *)e + head;
  ddp_status st = DDP_OK;
  for (int i = 0; i < n && st == DDP_OK; i++) {
    ddp_state_entry s;
    bool dev;
    st = ddp__model_state_entry_any(model, i, &s, &dev);
    if (st != DDP_OK) break;
    e[i].name = s.name;
    e[i].dtype = s.dtype;
    e[i].ndim = s.ndim;
    memcpy(e[i].shape, s.shape, sizeof e[i].shape);
    e[i].data = s.data;
    if (dev) {
      size_t bytes = (size_t)s.numel * ddp_dtype_size(s.dtype);
      st = ddp_device_copy_async(DDP_CPU, host, ddp_model_device(model), s.data, bytes);
      e[i].data = host;
      host += (bytes + 63) & ~(size_t)63;
    }
  }
  /* The copies to the host are complete once the device has done them. */
  if (st == DDP_OK && host_bytes) st = ddp_device_synchronize(ddp_model_device(model));
  if (st != DDP_OK) {
    ddp_free(e);
    char dev[DDP_DEVICE_STR_BYTES];
    return ddp_error_wrap(st, "checkpoint: copying model %s's state from %s", ddp_model_name(model),
                          ddp_device_str(ddp_model_device(model), dev, sizeof dev));
  }
  *out = e;
  *count = n;
  return DDP_OK;
}

ddp_status ddp_model_save(const ddp_model *model, const char *path, const ddp_kv *metadata,
                          size_t metadata_count) {
  ddp_safetensors_entry *entries;
  int n;
  DDP_TRY(ddp__model_state_entries(model, &entries, &n));
  ddp_kv meta[2 + 64];
  if (metadata_count > 64) {
    ddp_free(entries);
    return ddp_error(DDP_ERR_INVALID, "checkpoint: %zu metadata pairs (at most 64)", metadata_count);
  }
  meta[0] = (ddp_kv){"format", "pt"};
  meta[1] = (ddp_kv){"ddp.model", ddp_model_name(model)};
  for (size_t i = 0; i < metadata_count; i++) meta[2 + i] = metadata[i];
  ddp_status s = ddp_safetensors_write(path, entries, (size_t)n, meta, 2 + metadata_count);
  ddp_free(entries);
  return s;
}

/* The model entry a file name stands for: the name itself or, with a
 * "module." prefix (DistributedDataParallel's state_dict), the rest. */
static const char *strip_module(const char *name) {
  return strncmp(name, "module.", 7) == 0 ? name + 7 : name;
}

/* Appends ", \"name\"" to a list, keeping it short: after a few names only
 * the count grows. */
static void list_add(char *buf, size_t n, int *count, const char *name) {
  if (*count < 8) {
    size_t k = strlen(buf);
    snprintf(buf + k, n - k, "%s\"%s\"", *count ? ", " : "", name);
  }
  (*count)++;
}

ddp_status ddp__model_state_check(const ddp_model *model, const ddp_safetensors *st) {
  const char *path = ddp_safetensors_path(st);
  int n = ddp_model_state_count(model);
  int *source = ddp_alloc((n ? (size_t)n : 1) * sizeof *source); /* file index per entry */
  if (!source) return ddp_error(DDP_ERR_NOMEM, "checkpoint: cannot allocate");
  for (int i = 0; i < n; i++) source[i] = -1;
  char unexpected[1024] = "", missing[1024] = "";
  int n_unexpected = 0, n_missing = 0;
  ddp_status s = DDP_OK;
  size_t count = ddp_safetensors_count(st);
  for (size_t k = 0; k < count && s == DDP_OK; k++) {
    ddp_safetensors_tensor t;
    ddp_safetensors_get(st, k, &t);
    const char *name = strip_module(t.name);
    int found = -1;
    for (int i = 0; i < n && found < 0; i++) {
      ddp_state_entry e;
      bool dev;
      ddp__model_state_entry_any(model, i, &e, &dev);
      if (!strcmp(e.name, name)) found = i;
    }
    if (found < 0) {
      list_add(unexpected, sizeof unexpected, &n_unexpected, t.name);
    } else if (source[found] >= 0) {
      ddp_safetensors_tensor other;
      ddp_safetensors_get(st, (size_t)source[found], &other);
      s = ddp_error(DDP_ERR_FORMAT, "checkpoint: %s: tensors %s and %s are both %s (one with a "
                    "\"module.\" prefix)", path, other.name, t.name, name);
    } else {
      source[found] = (int)k;
    }
  }
  for (int i = 0; i < n && s == DDP_OK; i++)
    if (source[i] < 0) {
      ddp_state_entry e;
      bool dev;
      ddp__model_state_entry_any(model, i, &e, &dev);
      list_add(missing, sizeof missing, &n_missing, e.name);
    }
  if (s == DDP_OK && (n_missing || n_unexpected)) {
    char more_m[32] = "", more_u[32] = "";
    if (n_missing > 8) snprintf(more_m, sizeof more_m, " and %d more", n_missing - 8);
    if (n_unexpected > 8) snprintf(more_u, sizeof more_u, " and %d more", n_unexpected - 8);
    s = ddp_error(DDP_ERR_FORMAT, "checkpoint: %s does not fit model %s (strict load): "
                  "missing key(s): %s%s%s; unexpected key(s): %s%s%s (saved from another model "
                  "or other options?)", path, ddp_model_name(model), n_missing ? missing : "none",
                  more_m, "", n_unexpected ? unexpected : "none", more_u, "");
  }
  for (int i = 0; i < n && s == DDP_OK; i++) {
    ddp_state_entry e;
    ddp_safetensors_tensor t;
    bool dev;
    ddp__model_state_entry_any(model, i, &e, &dev);
    ddp_safetensors_get(st, (size_t)source[i], &t);
    bool same = t.ndim == e.ndim && t.dtype == e.dtype;
    for (int d = 0; same && d < e.ndim; d++) same = t.shape[d] == e.shape[d];
    if (!same) {
      char a[160], b[160];
      shape_str(t.ndim, t.shape, a, sizeof a);
      shape_str(e.ndim, e.shape, b, sizeof b);
      s = ddp_error(DDP_ERR_SHAPE, "checkpoint: %s: size mismatch for %s (tensor %s at offset "
                    "%llu): the file has %s %s, the model %s %s", path, e.name, t.name,
                    (unsigned long long)t.file_offset, ddp_safetensors_dtype_name(t.dtype), a,
                    ddp_safetensors_dtype_name(e.dtype), b);
    }
  }
  ddp_free(source);
  return s;
}

ddp_status ddp__model_state_apply(ddp_model *model, const ddp_safetensors *st) {
  size_t count = ddp_safetensors_count(st);
  bool any_device = false;
  ddp_status s = DDP_OK;
  for (size_t k = 0; k < count && s == DDP_OK; k++) {
    ddp_safetensors_tensor t;
    ddp_safetensors_get(st, k, &t);
    /* Checked by ddp__model_state_check: every name resolves. */
    int index = -1;
    for (int i = 0; i < ddp_model_state_count(model) && index < 0; i++) {
      ddp_state_entry e;
      bool dev;
      ddp__model_state_entry_any(model, i, &e, &dev);
      if (!strcmp(e.name, strip_module(t.name))) index = i;
    }
    DDP_ASSERT(index >= 0);
    ddp_state_entry e;
    bool dev;
    ddp__model_state_entry_any(model, index, &e, &dev);
    DDP_ASSERT(t.bytes == (size_t)e.numel * ddp_dtype_size(e.dtype));
    if (!t.bytes) continue;
    if (dev) {
      /* From the file's pages to the GPU, queued on its stream. */
      s = ddp_device_copy_async(ddp_model_device(model), e.data, DDP_CPU, t.data, t.bytes);
      any_device = true;
    } else {
      memcpy(e.data, t.data, t.bytes);
    }
  }
  /* The file's pages must outlive the copies: wait for them here. */
  if (any_device) {
    ddp_status w = ddp_device_synchronize(ddp_model_device(model));
    if (s == DDP_OK) s = w;
  }
  if (s != DDP_OK) {
    char d[DDP_DEVICE_STR_BYTES];
    return ddp_error_wrap(s, "checkpoint: copying %s into model %s on %s", ddp_safetensors_path(st),
                          ddp_model_name(model), ddp_device_str(ddp_model_device(model), d, sizeof d));
  }
  return DDP_OK;
}

ddp_status ddp_model_load_from(ddp_model *model, const ddp_safetensors *st) {
  DDP_TRY(ddp__model_state_check(model, st));
  return ddp__model_state_apply(model, st);
}

ddp_status ddp_model_load(ddp_model *model, const char *path) {
  ddp_safetensors *st;
  DDP_TRY(ddp_safetensors_read(path, &st));
  ddp_status s = ddp_model_load_from(model, st);
  ddp_safetensors_free(st);
  return s;
}
