/* Sharded checkpoints (include/ddp/io.h, docs/sharding.md): every rank
 * writes the pieces of the parameters and optimizer state in its range of
 * the flat buffers; rank 0 writes the metadata file (training state,
 * buffers, the layout of every tensor's pieces) last. Loading assembles the
 * whole tensors from whatever number of shards wrote them. The layer below
 * the collectives: the caller (the trainer) orders the writes with a
 * barrier. */
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "io/io_internal.h"
#include "io/model_state.h"

#define META_FILE "metadata.safetensors"
#define MAX_WORLD 4096

static ddp_status join(char *buf, size_t bytes, const char *dir, const char *name) {
  int w = snprintf(buf, bytes, "%s/%s", dir, name);
  if (w < 0 || (size_t)w >= bytes)
    return ddp_error(DDP_ERR_RANGE, "sharded checkpoint: path %s/%s too long", dir, name);
  return DDP_OK;
}

static void shard_name(char *buf, size_t bytes, const char *id, int rank, int world) {
  snprintf(buf, bytes, "shard-%05d-of-%05d.%s.safetensors", rank, world, id);
}

static ddp_status make_dir(const char *dir) {
  if (mkdir(dir, 0777) == 0 || errno == EEXIST) return DDP_OK;
  return ddp_error(DDP_ERR_IO, "sharded checkpoint: cannot create directory %s: %s", dir,
                   strerror(errno));
}

bool ddp_sharded_is_checkpoint(const char *path) {
  char p[4096];
  struct stat sb;
  if (!path || stat(path, &sb) != 0 || !S_ISDIR(sb.st_mode)) return false;
  return join(p, sizeof p, path, META_FILE) == DDP_OK && access(p, F_OK) == 0;
}

/* ---- Pieces -------------------------------------------------------------------
 * A tensor of the flat buffers (a parameter, or an optimizer state buffer
 * shaped like one) at flat offset `at`, numel floats, meets rank r's range
 * in [from, to): that piece is rank r's, at offset from - at of the tensor. */
static bool meet(int64_t at, int64_t numel, int64_t lo, int64_t hi, int64_t *from, int64_t *to) {
  *from = at > lo ? at : lo;
  *to = at + numel < hi ? at + numel : hi;
  return *from < *to;
}

/* The optimizer's state buffers that hold values: count and names. */
static size_t state_buffers(ddp_optimizer *opt, ddp_optim_state *out, size_t cap) {
  size_t n = 0;
  if (!opt || !ddp_optimizer_has_state(opt)) return 0;
  for (size_t k = 0; k < ddp_optimizer_state_count(opt) && n < cap; k++) {
    ddp_optim_state st;
    if (ddp_optimizer_state_get(opt, k, &st) == DDP_OK && !st.is_scalar) out[n++] = st;
  }
  return n;
}

ddp_status ddp_sharded_save_shard(const char *dir, const char *id, int rank, int world,
                                  const int64_t *starts, const ddp_model *model_c,
                                  ddp_optimizer *opt) {
  ddp_model *model = (ddp_model *)model_c; /* read only; nn hands parameters out mutable */
  const int64_t lo = starts[rank], hi = starts[rank + 1], n = ddp_model_num_param_elements(model);
  /* The optimizer's data index of flat float f: narrowed to the range, or whole. */
  int64_t opt_base = 0;
  if (opt && ddp_optimizer_numel(opt) == (size_t)(hi - lo)) opt_base = lo;
  else if (opt && ddp_optimizer_numel(opt) != (size_t)n)
    return ddp_error(DDP_ERR_INVALID, "sharded checkpoint: rank %d: the optimizer covers %zu "
                     "floats, neither its range (%lld) nor the model (%lld)", rank,
                     ddp_optimizer_numel(opt), (long long)(hi - lo), (long long)n);
  ddp_optim_state bufs[4];
  const size_t nb = state_buffers(opt, bufs, 4);
  const int n_state = ddp_model_state_count(model), n_params = ddp_model_num_params(model);
  const size_t cap = (size_t)n_state + (size_t)n_params * nb + 1;
  ddp_safetensors_entry *e = ddp_calloc(cap, sizeof *e);
  char *names = ddp_calloc(cap, 128);
  if (!e || !names) {
    ddp_free(e);
    ddp_free(names);
    return ddp_error(DDP_ERR_NOMEM, "sharded checkpoint: cannot allocate %zu entries", cap);
  }
  size_t count = 0;
  for (int i = 0; i < n_state; i++) {
    ddp_state_entry se;
    ddp_model_state_entry(model, i, &se);
    int64_t from = 0, to = se.numel;
    if (se.is_param) {
      int64_t at = ddp_model_param_offset(model, se.param_index);
      if (!meet(at, se.numel, lo, hi, &from, &to)) continue;
      from -= at;
      to -= at;
    } else if (rank != 0) {
      continue; /* buffers: rank 0 writes them whole */
    }
    ddp_safetensors_entry *x = &e[count++];
    x->name = se.name;
    x->dtype = se.dtype;
    x->ndim = 1;
    x->shape[0] = to - from;
    x->data = (const char *)se.data + (size_t)from * ddp_dtype_size(se.dtype);
  }
  for (size_t k = 0; k < nb; k++)
    for (int i = 0; i < n_params; i++) {
      int64_t at = ddp_model_param_offset(model, i), from, to;
      if (!meet(at, ddp_model_param(model, i)->numel, lo, hi, &from, &to)) continue;
      char *name = names + count * 128;
      snprintf(name, 128, "optimizer.state.%d.%s", i, bufs[k].name);
      ddp_safetensors_entry *x = &e[count++];
      x->name = name;
      x->dtype = DDP_FLOAT32;
      x->ndim = 1;
      x->shape[0] = to - from;
      x->data = bufs[k].data + (from - opt_base);
    }
  char rank_s[32], file[256], path[4096];
  snprintf(rank_s, sizeof rank_s, "%d/%d", rank, world);
  shard_name(file, sizeof file, id, rank, world);
  const ddp_kv meta[] = {{"ddp.kind", "shard"}, {"ddp.checkpoint_id", id}, {"ddp.shard", rank_s}};
  ddp_status s = make_dir(dir);
  if (s == DDP_OK) s = join(path, sizeof path, dir, file);
  if (s == DDP_OK) s = ddp_safetensors_write(path, e, count, meta, 3);
  ddp_free(e);
  ddp_free(names);
  return s == DDP_OK ? DDP_OK : ddp_error_wrap(s, "sharded checkpoint: rank %d's shard", rank);
}

/* ---- The layout: JSON in the metadata file's "ddp.layout" ------------------------
 * {"world": W, "files": [shard file of each rank], "tensors": [{"name": N,
 * "dtype": "F32", "shape": [...], "pieces": [[rank, offset, numel], ...]},
 * ...]}: the model's state entries in state_dict order, then the optimizer's
 * buffers; pieces in rank order, each starting where the last ended. */

typedef struct text {
  char *buf;
  size_t len, cap;
  bool nomem;
} text;

static void put(text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(text *t, const char *fmt, ...) {
  for (;;) {
    va_list ap;
    va_start(ap, fmt);
    int w = vsnprintf(t->buf ? t->buf + t->len : NULL, t->buf ? t->cap - t->len : 0, fmt, ap);
    va_end(ap);
    if (w < 0 || t->nomem) return;
    if (t->buf && t->len + (size_t)w < t->cap) {
      t->len += (size_t)w;
      return;
    }
    size_t cap = (t->cap ? t->cap * 2 : 4096) + (size_t)w;
    char *b = ddp_realloc(t->buf, t->cap, cap);
    if (!b) {
      t->nomem = true;
      return;
    }
    t->buf = b;
    t->cap = cap;
  }
}

static void put_tensor(text *t, bool *first, const char *name, ddp_dtype dtype, int ndim,
                       const int64_t *shape, int64_t at, int64_t numel, bool flat, int world,
                       const int64_t *starts) {
  put(t, "%s{\"name\": ", *first ? "" : ", ");
  *first = false;
  size_t pos = 0;
  char quoted[512];
  if (!ddp__json_put_string(quoted, sizeof quoted, &pos, name)) pos = 0;
  put(t, "%.*s, \"dtype\": \"%s\", \"shape\": [", (int)pos, quoted, ddp_safetensors_dtype_name(dtype));
  for (int d = 0; d < ndim; d++) put(t, "%s%lld", d ? ", " : "", (long long)shape[d]);
  put(t, "], \"pieces\": [");
  if (!flat) {
    put(t, "[0, 0, %lld]", (long long)numel);
  } else {
    bool firstp = true;
    for (int r = 0; r < world; r++) {
      int64_t from, to;
      if (!meet(at, numel, starts[r], starts[r + 1], &from, &to)) continue;
      put(t, "%s[%d, %lld, %lld]", firstp ? "" : ", ", r, (long long)(from - at), (long long)(to - from));
      firstp = false;
    }
  }
  put(t, "]}");
}

static ddp_status build_layout(text *t, const char *id, int world, const int64_t *starts,
                               ddp_model *model, ddp_optimizer *opt) {
  put(t, "{\"world\": %d, \"files\": [", world);
  for (int r = 0; r < world; r++) {
    char file[256];
    shard_name(file, sizeof file, id, r, world);
    put(t, "%s\"%s\"", r ? ", " : "", file);
  }
  put(t, "], \"tensors\": [");
  bool first = true;
  for (int i = 0; i < ddp_model_state_count(model); i++) {
    ddp_state_entry se;
    ddp_model_state_entry(model, i, &se);
    put_tensor(t, &first, se.name, se.dtype, se.ndim, se.shape,
               se.is_param ? ddp_model_param_offset(model, se.param_index) : 0, se.numel,
               se.is_param, world, starts);
  }
  ddp_optim_state bufs[4];
  size_t nb = state_buffers(opt, bufs, 4);
  for (size_t k = 0; k < nb; k++)
    for (int i = 0; i < ddp_model_num_params(model); i++) {
      ddp_tensor *p = ddp_model_param(model, i);
      char name[128];
      snprintf(name, sizeof name, "optimizer.state.%d.%s", i, bufs[k].name);
      put_tensor(t, &first, name, DDP_FLOAT32, p->ndim, p->shape, ddp_model_param_offset(model, i),
                 p->numel, true, world, starts);
    }
  put(t, "]}");
  if (t->nomem) return ddp_error(DDP_ERR_NOMEM, "sharded checkpoint: cannot allocate the layout");
  return DDP_OK;
}

/* Removes the shard files in dir of saves other than id (best effort: a
 * leftover costs disk, not correctness, since the metadata names its own). */
static void remove_other_shards(const char *dir, const char *id) {
  DIR *d = opendir(dir);
  if (!d) return;
  struct dirent *ent;
  char keep[160], path[4096];
  snprintf(keep, sizeof keep, ".%s.safetensors", id);
  while ((ent = readdir(d))) {
    const char *nm = ent->d_name;
    size_t len = strlen(nm), kl = strlen(keep);
    if (strncmp(nm, "shard-", 6) != 0 || !strstr(nm, ".safetensors")) continue;
    if (len >= kl && !strcmp(nm + len - kl, keep)) continue;
    if (join(path, sizeof path, dir, nm) == DDP_OK && unlink(path) != 0)
      DDP_WARN("sharded checkpoint: cannot remove the old shard %s: %s", path, strerror(errno));
  }
  closedir(d);
}

ddp_status ddp_sharded_save_metadata(const char *dir, const char *id, int world,
                                     const int64_t *starts, const ddp_model *model_c,
                                     ddp_optimizer *opt, const ddp_scheduler *sched,
                                     const ddp_train_state *ts, const ddp_kv *metadata,
                                     size_t metadata_count) {
  ddp_model *model = (ddp_model *)model_c;
  if (metadata_count > 64)
    return ddp_error(DDP_ERR_INVALID, "sharded checkpoint: %zu metadata pairs (at most 64)", metadata_count);
  text layout = {0};
  ddp__ckpt_entries *te = NULL;
  ddp_safetensors_entry *e = NULL;
  ddp_status s = build_layout(&layout, id, world, starts, model, opt);
  if (s == DDP_OK) s = ddp__ckpt_train_entries(&te, model, NULL, sched, ts);
  /* The training state's entries, the optimizer's lr and scalars, the
   * buffers are in rank 0's shard. */
  size_t n_train = 0;
  const ddp_safetensors_entry *train = te ? ddp__ckpt_entries_get(te, &n_train) : NULL;
  double lr = opt ? ddp_optimizer_get_lr(opt) : 0;
  ddp_optim_state step = {0};
  bool has_step = opt && ddp_optimizer_has_state(opt) &&
                  ddp_optimizer_state_find(opt, "step", &step) == DDP_OK;
  if (s == DDP_OK) {
    e = ddp_calloc(n_train + 2, sizeof *e);
    if (!e) s = ddp_error(DDP_ERR_NOMEM, "sharded checkpoint: cannot allocate");
  }
  size_t count = 0;
  if (s == DDP_OK) {
    memcpy(e, train, n_train * sizeof *e);
    count = n_train;
    if (opt) e[count++] = (ddp_safetensors_entry){.name = "optimizer.param_groups.0.lr",
                                                  .dtype = DDP_FLOAT64, .data = &lr};
    if (has_step) e[count++] = (ddp_safetensors_entry){.name = "optimizer.state.step",
                                                       .dtype = DDP_FLOAT32, .data = step.data};
  }
  char world_s[32], path[4096];
  snprintf(world_s, sizeof world_s, "%d", world);
  ddp_kv meta[6 + 64];
  meta[0] = (ddp_kv){"ddp.kind", "sharded-checkpoint"};
  meta[1] = (ddp_kv){"ddp.checkpoint_id", id};
  meta[2] = (ddp_kv){"ddp.model", ddp_model_name(model)};
  meta[3] = (ddp_kv){"ddp.optimizer", opt ? ddp_optim_kind_name(ddp_optimizer_options(opt)->kind) : "none"};
  meta[4] = (ddp_kv){"ddp.world_size", world_s};
  meta[5] = (ddp_kv){"ddp.layout", layout.buf ? layout.buf : ""};
  for (size_t i = 0; i < metadata_count; i++) meta[6 + i] = metadata[i];
  if (s == DDP_OK) s = make_dir(dir);
  if (s == DDP_OK) s = join(path, sizeof path, dir, META_FILE);
  if (s == DDP_OK) s = ddp_safetensors_write(path, e, count, meta, 6 + metadata_count);
  if (s == DDP_OK) remove_other_shards(dir, id);
  ddp_free(e);
  ddp__ckpt_entries_free(te);
  ddp_free(layout.buf);
  return s == DDP_OK ? DDP_OK : ddp_error_wrap(s, "sharded checkpoint %s: the metadata", dir);
}

/* ---- Reading ----------------------------------------------------------------- */

typedef struct whole {
  const char *name;  /* into the layout's JSON */
  ddp_dtype dtype;
  int ndim;
  int64_t shape[DDP_MAX_DIMS];
  int64_t numel;
  void *data;        /* assembled, ddp_alloc'd */
} whole;

typedef struct sharded {
  char dir[4096];
  ddp_safetensors *meta;
  ddp__json_doc doc;
  int world;
  ddp_safetensors **shards; /* (world) */
  whole *tensors;
  size_t n_tensors;
} sharded;

static void sharded_free(sharded *c) {
  ddp_safetensors_free(c->meta);
  ddp__json_free(&c->doc);
  for (int r = 0; c->shards && r < c->world; r++) ddp_safetensors_free(c->shards[r]);
  ddp_free(c->shards);
  for (size_t i = 0; c->tensors && i < c->n_tensors; i++) ddp_free(c->tensors[i].data);
  ddp_free(c->tensors);
}

static ddp_status bad_layout(const sharded *c, const char *what, const char *tensor) {
  return ddp_error(DDP_ERR_FORMAT, "sharded checkpoint %s: %s/" META_FILE ": ddp.layout: %s%s%s",
                   c->dir, c->dir, what, tensor ? " (tensor " : "", tensor ? tensor : "");
}

static bool is_int(const ddp__json *v, int64_t lo, int64_t hi) {
  return v && v->kind == DDP__JSON_NUMBER && v->is_integer && v->integer >= lo && v->integer <= hi;
}

static ddp_status dtype_of(const char *name, ddp_dtype *out) {
  static const ddp_dtype known[] = {DDP_FLOAT32, DDP_INT64, DDP_FLOAT64, DDP_INT32};
  for (size_t i = 0; i < sizeof known / sizeof *known; i++)
    if (!strcmp(name, ddp_safetensors_dtype_name(known[i]))) {
      *out = known[i];
      return DDP_OK;
    }
  return DDP_ERR_FORMAT;
}

/* One tensor of the layout, assembled from its pieces. */
static ddp_status assemble(sharded *c, const ddp__json *t, whole *w) {
  const ddp__json *name = ddp__json_get(t, "name"), *dt = ddp__json_get(t, "dtype"),
                  *shape = ddp__json_get(t, "shape"), *pieces = ddp__json_get(t, "pieces");
  if (!name || name->kind != DDP__JSON_STRING) return bad_layout(c, "a tensor without a name", NULL);
  w->name = name->string;
  if (!dt || dt->kind != DDP__JSON_STRING || dtype_of(dt->string, &w->dtype) != DDP_OK)
    return bad_layout(c, "a dtype that is not F32, F64, I32 or I64", w->name);
  if (!shape || shape->kind != DDP__JSON_ARRAY || shape->count > DDP_MAX_DIMS || !pieces ||
      pieces->kind != DDP__JSON_ARRAY)
    return bad_layout(c, "no shape or pieces", w->name);
  w->ndim = (int)shape->count;
  w->numel = 1;
  int d = 0;
  for (const ddp__json *x = shape->first; x; x = x->next, d++) {
    if (!is_int(x, 0, INT64_C(1) << 40)) return bad_layout(c, "a shape entry out of range", w->name);
    w->shape[d] = x->integer;
    w->numel *= x->integer;
    if (w->numel > INT64_C(1) << 40) return bad_layout(c, "a tensor over 2^40 elements", w->name);
  }
  const size_t es = ddp_dtype_size(w->dtype);
  w->data = ddp_alloc(w->numel ? (size_t)w->numel * es : 1);
  if (!w->data) return ddp_error(DDP_ERR_NOMEM, "sharded checkpoint: cannot allocate %s", w->name);
  int64_t next = 0; /* pieces tile the tensor in order */
  for (const ddp__json *p = pieces->first; p; p = p->next) {
    const ddp__json *r = p->kind == DDP__JSON_ARRAY && p->count == 3 ? p->first : NULL;
    const ddp__json *off = r ? r->next : NULL, *len = off ? off->next : NULL;
    if (!is_int(r, 0, c->world - 1) || !is_int(off, 0, w->numel) || !is_int(len, 1, w->numel))
      return bad_layout(c, "a piece that is not [rank, offset, numel] within the tensor", w->name);
    if (off->integer != next || off->integer + len->integer > w->numel)
      return ddp_error(DDP_ERR_FORMAT, "sharded checkpoint %s: tensor %s: the piece of rank %lld "
                       "at offset %lld (%lld elements) does not continue where the last ended "
                       "(%lld) within its %lld elements", c->dir, w->name, (long long)r->integer,
                       (long long)off->integer, (long long)len->integer, (long long)next,
                       (long long)w->numel);
    ddp_safetensors *sh = c->shards[r->integer];
    ddp_safetensors_tensor st;
    ddp_status s = ddp_safetensors_find(sh, w->name, &st);
    if (s != DDP_OK) return ddp_error_wrap(s, "sharded checkpoint %s: the metadata's piece of rank %lld", c->dir, (long long)r->integer);
    if (st.dtype != w->dtype || st.numel != len->integer)
      return ddp_error(DDP_ERR_FORMAT, "sharded checkpoint %s: %s: %s at offset %llu is %s with "
                       "%lld elements; the metadata says %s with %lld", c->dir,
                       ddp_safetensors_path(sh), w->name, (unsigned long long)st.file_offset,
                       ddp_safetensors_dtype_name(st.dtype), (long long)st.numel,
                       ddp_safetensors_dtype_name(w->dtype), (long long)len->integer);
    memcpy((char *)w->data + (size_t)off->integer * es, st.data, st.bytes);
    next += len->integer;
  }
  if (next != w->numel)
    return ddp_error(DDP_ERR_FORMAT, "sharded checkpoint %s: tensor %s: the pieces cover %lld of "
                     "its %lld elements", c->dir, w->name, (long long)next, (long long)w->numel);
  return DDP_OK;
}

/* Reads the metadata, every shard it names, and assembles every tensor. */
static ddp_status sharded_read(sharded *c, const char *dir) {
  memset(c, 0, sizeof *c);
  snprintf(c->dir, sizeof c->dir, "%s", dir);
  char path[4096];
  DDP_TRY(join(path, sizeof path, dir, META_FILE));
  DDP_TRY(ddp_safetensors_read(path, &c->meta));
  const char *kind = ddp_safetensors_metadata(c->meta, "ddp.kind");
  const char *id = ddp_safetensors_metadata(c->meta, "ddp.checkpoint_id");
  const char *layout = ddp_safetensors_metadata(c->meta, "ddp.layout");
  if (!kind || strcmp(kind, "sharded-checkpoint") || !id || !layout)
    return ddp_error(DDP_ERR_FORMAT, "sharded checkpoint: %s is not a sharded checkpoint's "
                     "metadata (ddp.kind, ddp.checkpoint_id, ddp.layout)", path);
  ddp_status s = ddp__json_parse(layout, strlen(layout), 0, &c->doc);
  if (s != DDP_OK) return ddp_error_wrap(s, "sharded checkpoint %s: ddp.layout", path);
  const ddp__json *root = c->doc.root, *world = ddp__json_get(root, "world"),
                  *files = ddp__json_get(root, "files"), *tensors = ddp__json_get(root, "tensors");
  if (!is_int(world, 1, MAX_WORLD) || !files || files->kind != DDP__JSON_ARRAY ||
      files->count != (size_t)world->integer || !tensors || tensors->kind != DDP__JSON_ARRAY)
    return bad_layout(c, "no world (1..4096), files of each rank or tensors", NULL);
  c->world = (int)world->integer;
  c->shards = ddp_calloc((size_t)c->world, sizeof *c->shards);
  c->tensors = ddp_calloc(tensors->count ? tensors->count : 1, sizeof *c->tensors);
  if (!c->shards || !c->tensors) return ddp_error(DDP_ERR_NOMEM, "sharded checkpoint: cannot allocate");
  int r = 0;
  for (const ddp__json *f = files->first; f; f = f->next, r++) {
    if (f->kind != DDP__JSON_STRING || strchr(f->string, '/'))
      return bad_layout(c, "a shard file name that is not a plain name", NULL);
    DDP_TRY(join(path, sizeof path, dir, f->string));
    DDP_TRY(ddp_safetensors_read(path, &c->shards[r]));
    const char *sid = ddp_safetensors_metadata(c->shards[r], "ddp.checkpoint_id");
    if (!sid || strcmp(sid, id))
      return ddp_error(DDP_ERR_FORMAT, "sharded checkpoint %s: %s has checkpoint id %s, the "
                       "metadata %s: files of different saves", dir, path, sid ? sid : "none", id);
  }
  for (const ddp__json *t = tensors->first; t; t = t->next) {
    /* Counted before the check: a failed assembly's buffer is freed too. */
    ddp_status s = assemble(c, t, &c->tensors[c->n_tensors++]);
    if (s != DDP_OK) return s;
  }
  return DDP_OK;
}

static const whole *find_whole(const sharded *c, const char *name) {
  for (size_t i = 0; i < c->n_tensors; i++)
    if (!strcmp(c->tensors[i].name, name)) return &c->tensors[i];
  return NULL;
}

/* Checks one assembled tensor against a wanted dtype and shape. */
static ddp_status check_shape(const sharded *c, const whole *w, const char *name, ddp_dtype dtype,
                              int ndim, const int64_t *shape) {
  if (!w) return ddp_error(DDP_ERR_FORMAT, "sharded checkpoint %s: no tensor %s", c->dir, name);
  bool ok = w->dtype == dtype && w->ndim == ndim;
  for (int d = 0; ok && d < ndim; d++) ok = w->shape[d] == shape[d];
  if (!ok)
    return ddp_error(DDP_ERR_SHAPE, "sharded checkpoint %s: %s is %s with %d dimensions, not "
                     "what this run has (%s, %d dimensions)", c->dir, name,
                     ddp_safetensors_dtype_name(w->dtype), w->ndim,
                     ddp_safetensors_dtype_name(dtype), ndim);
  return DDP_OK;
}

ddp_status ddp_sharded_load(const char *dir, ddp_model *model, ddp_optimizer *opt,
                            ddp_scheduler *sched, ddp_train_state *ts, const ddp_kv *expect,
                            size_t expect_count) {
  const int64_t n = ddp_model_num_param_elements(model);
  if (opt && ddp_optimizer_numel(opt) != (size_t)n)
    return ddp_error(DDP_ERR_INVALID, "sharded checkpoint: load into an optimizer over the "
                     "model's %lld floats (this one covers %zu)", (long long)n, ddp_optimizer_numel(opt));
  sharded c;
  float *staging = NULL;
  ddp_status s = sharded_read(&c, dir);
  const char *saved_model = s == DDP_OK ? ddp_safetensors_metadata(c.meta, "ddp.model") : NULL;
  if (s == DDP_OK && (!saved_model || strcmp(saved_model, ddp_model_name(model))))
    s = ddp_error(DDP_ERR_INVALID, "sharded checkpoint %s was saved from model %s; this run "
                  "builds %s", dir, saved_model ? saved_model : "(unknown)", ddp_model_name(model));
  for (size_t i = 0; s == DDP_OK && i < expect_count; i++) {
    const char *v = ddp_safetensors_metadata(c.meta, expect[i].key);
    if (!v || strcmp(v, expect[i].value))
      s = ddp_error(DDP_ERR_INVALID, "sharded checkpoint %s was saved with %s = %s; this run has "
                    "%s = %s (resume with the options it was saved with)", dir, expect[i].key,
                    v ? v : "(not recorded)", expect[i].key, expect[i].value);
  }
  /* Check everything first. */
  ddp_train_state t;
  ddp_rng rng;
  ddp_scheduler_state ss;
  double lr = 0;
  float step = 0;
  bool has_step = false;
  ddp_grad_scaler saved_scaler;
  bool has_scaler = false;
  if (s == DDP_OK)
    s = ddp__ckpt_read_train(c.meta, model, sched, &t, &rng, &ss, &saved_scaler, &has_scaler);
  size_t model_tensors = 0;
  for (int i = 0; s == DDP_OK && i < ddp_model_state_count(model); i++) {
    ddp_state_entry se;
    ddp_model_state_entry(model, i, &se);
    s = check_shape(&c, find_whole(&c, se.name), se.name, se.dtype, se.ndim, se.shape);
    model_tensors++;
  }
  size_t optim_tensors = 0;
  if (s == DDP_OK && opt) {
    s = ddp__ckpt_get_scalar(c.meta, "optimizer.param_groups.0.lr", DDP_FLOAT64, &lr);
    ddp_safetensors_tensor st;
    if (s == DDP_OK && ddp_safetensors_find(c.meta, "optimizer.state.step", &st) == DDP_OK) {
      s = ddp__ckpt_get_scalar(c.meta, "optimizer.state.step", DDP_FLOAT32, &step);
      has_step = true;
    }
    staging = ddp_alloc((size_t)n * ddp_optimizer_state_count(opt) * sizeof(float) + 1);
    if (s == DDP_OK && !staging) s = ddp_error(DDP_ERR_NOMEM, "sharded checkpoint: cannot allocate");
    for (size_t k = 0; s == DDP_OK && k < ddp_optimizer_state_count(opt); k++) {
      ddp_optim_state os;
      ddp_optimizer_state_get(opt, k, &os);
      if (os.is_scalar) continue;
      for (int i = 0; s == DDP_OK && i < ddp_model_num_params(model); i++) {
        ddp_tensor *p = ddp_model_param(model, i);
        char name[128];
        snprintf(name, sizeof name, "optimizer.state.%d.%s", i, os.name);
        const whole *w = find_whole(&c, name);
        if (!w && i == 0) break; /* saved before any step: no state */
        s = check_shape(&c, w, name, DDP_FLOAT32, p->ndim, p->shape);
        if (s == DDP_OK)
          memcpy(staging + k * (size_t)n + ddp_model_param_offset(model, i), w->data,
                 (size_t)p->numel * sizeof(float));
        optim_tensors++;
      }
    }
  }
  /* Strict, as load_state_dict(strict=True): nothing the run does not take
   * (the optimizer's state is left out of the count when it is skipped). */
  size_t saved = 0;
  for (size_t i = 0; i < c.n_tensors; i++)
    saved += opt || strncmp(c.tensors[i].name, "optimizer.", 10) != 0;
  if (s == DDP_OK && saved != model_tensors + optim_tensors)
    s = ddp_error(DDP_ERR_FORMAT, "sharded checkpoint %s holds %zu tensors where this model%s "
                  "take %zu (another model, or another optimizer's state)", dir, saved,
                  opt ? " and optimizer" : "", model_tensors + optim_tensors);
  /* Apply: nothing fails from here. */
  if (s == DDP_OK) {
    for (int i = 0; i < ddp_model_state_count(model); i++) {
      ddp_state_entry se;
      ddp_model_state_entry(model, i, &se);
      const whole *w = find_whole(&c, se.name);
      memcpy(se.data, w->data, (size_t)se.numel * ddp_dtype_size(se.dtype));
    }
    *ddp_model_dropout_rng(model) = rng;
    if (opt) {
      ddp_status ls = ddp_optimizer_set_lr(opt, lr);
      for (size_t k = 0; optim_tensors && k < ddp_optimizer_state_count(opt); k++) {
        ddp_optim_state os;
        ddp_optimizer_state_get(opt, k, &os);
        if (os.is_scalar && has_step) ls = ddp_optimizer_state_load(opt, os.name, &step, 1);
        else if (!os.is_scalar) ls = ddp_optimizer_state_load(opt, os.name, staging + k * (size_t)n, (size_t)n);
        DDP_ASSERT(ls == DDP_OK);
      }
    }
    if (sched) {
      ddp_status ls = ddp_scheduler_state_load(sched, &ss);
      DDP_ASSERT(ls == DDP_OK);
    }
    ddp_grad_scaler *gs = ts->grad_scaler;
    ddp__ckpt_apply_scaler(gs, &saved_scaler, has_scaler);
    *ts = t;
    ts->grad_scaler = gs;
  }
  ddp_free(staging);
  sharded_free(&c);
  return s == DDP_OK ? DDP_OK : ddp_error_wrap(s, "loading sharded checkpoint %s", dir);
}

ddp_status ddp_sharded_consolidate(const char *dir, const char *out) {
  sharded c;
  ddp_status s = sharded_read(&c, dir);
  ddp_safetensors_entry *e = NULL;
  size_t count = 0;
  if (s == DDP_OK) {
    e = ddp_calloc(c.n_tensors ? c.n_tensors : 1, sizeof *e);
    if (!e) s = ddp_error(DDP_ERR_NOMEM, "sharded checkpoint: cannot allocate");
  }
  /* The model's entries come first, in state_dict order; the optimizer's
   * are not part of a model's state dict. */
  for (size_t i = 0; s == DDP_OK && i < c.n_tensors; i++) {
    const whole *w = &c.tensors[i];
    if (!strncmp(w->name, "optimizer.", 10)) break;
    e[count++] = (ddp_safetensors_entry){.name = w->name, .dtype = w->dtype, .ndim = w->ndim,
                                         .data = w->data};
    memcpy(e[count - 1].shape, w->shape, sizeof w->shape);
  }
  const char *model = s == DDP_OK ? ddp_safetensors_metadata(c.meta, "ddp.model") : NULL;
  const ddp_kv meta[] = {{"format", "pt"}, {"ddp.model", model ? model : "unknown"}};
  if (s == DDP_OK) s = ddp_safetensors_write(out, e, count, meta, 2);
  ddp_free(e);
  sharded_free(&c);
  return s == DDP_OK ? DDP_OK : ddp_error_wrap(s, "consolidating sharded checkpoint %s", dir);
}
