/* Datasets: MNIST-format IDX directories (validated before they are used)
 * and the seeds' synthetic data, all held in memory. Pixels stay uint8 and
 * are converted to float32 per batch by ddp__dataset_gather. */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "data/dataset_internal.h"

#define TOYDATA_WIDTH 32 /* the seed's [float(x)] * 32 */
#define REGRESSION_INPUTS 10
#define REGRESSION_TARGETS 5

static ddp_status dataset_new(ddp_dataset **out, const char *name) {
  ddp_dataset *ds = ddp_calloc(1, sizeof *ds);
  if (!ds) return ddp_error(DDP_ERR_NOMEM, "dataset: cannot allocate");
  snprintf(ds->name, sizeof ds->name, "%s", name);
  ds->info.name = ds->name;
  *out = ds;
  return DDP_OK;
}

void ddp_dataset_destroy(ddp_dataset *ds) {
  if (!ds) return;
  ddp_free(ds->inputs);
  ddp_free(ds->targets);
  ddp_free(ds);
}

const ddp_dataset_info *ddp_dataset_get_info(const ddp_dataset *ds) { return &ds->info; }

int64_t ddp_dataset_size(const ddp_dataset *ds) { return ds->info.num_samples; }

ddp_status ddp_dataset_truncate(ddp_dataset *ds, int64_t n) {
  if (!ds || n < 1)
    return ddp_error(DDP_ERR_INVALID, "ddp_dataset_truncate: %s to %lld samples (>= 1)",
                     ds ? ds->info.name : "NULL dataset", (long long)n);
  if (n < ds->info.num_samples) ds->info.num_samples = n;
  return DDP_OK;
}

/* ---- IDX ----------------------------------------------------------------- */

/* ddp_dataset_open_idx on the first max_samples (0: all). */
static ddp_status open_idx(ddp_dataset **out, const char *images_path, const char *labels_path,
                           int64_t num_classes, int64_t max_samples) {
  *out = NULL;
  if (num_classes < 1 || num_classes > 256)
    return ddp_error(DDP_ERR_INVALID, "dataset: num_classes %lld outside [1, 256]",
                     (long long)num_classes);
  ddp_idx images, labels;
  DDP_TRY(ddp_idx_read_first(images_path, max_samples, &images));
  ddp_status status = ddp_idx_read_first(labels_path, max_samples, &labels);
  if (status != DDP_OK) {
    ddp_idx_free(&images);
    return status;
  }
  ddp_dataset *ds = NULL;
  int64_t *targets = NULL;
  if (images.type != DDP_IDX_UBYTE || images.ndim != 3) {
    status = ddp_error(DDP_ERR_FORMAT,
                       "dataset: %s: images must be unsigned bytes (type 0x08) of 3 dimensions "
                       "(N, H, W), but the file holds %s (type 0x%02x) of %d dimension%s",
                       images_path, ddp_idx_type_name(images.type), images.type, images.ndim,
                       images.ndim == 1 ? "" : "s");
    goto err;
  }
  if (labels.type != DDP_IDX_UBYTE || labels.ndim != 1) {
    status = ddp_error(DDP_ERR_FORMAT,
                       "dataset: %s: labels must be unsigned bytes (type 0x08) of 1 dimension "
                       "(N), but the file holds %s (type 0x%02x) of %d dimensions",
                       labels_path, ddp_idx_type_name(labels.type), labels.type, labels.ndim);
    goto err;
  }
  int64_t n = images.dims[0];
  if (labels.dims[0] != n) {
    status = ddp_error(DDP_ERR_FORMAT, "dataset: %s has %lld images but %s has %lld labels",
                       images_path, (long long)n, labels_path, (long long)labels.dims[0]);
    goto err;
  }
  if (n == 0 || images.dims[1] == 0 || images.dims[2] == 0) {
    status = ddp_error(DDP_ERR_FORMAT, "dataset: %s: holds no pixels (%lld images of %lldx%lld)",
                       images_path, (long long)n, (long long)images.dims[1],
                       (long long)images.dims[2]);
    goto err;
  }
  const uint8_t *raw_labels = labels.data;
  for (int64_t i = 0; i < n; i++)
    if (raw_labels[i] >= num_classes) {
      status = ddp_error(DDP_ERR_RANGE,
                         "dataset: %s: label %u at index %lld (offset %lld) is out of range "
                         "[0, %lld)",
                         labels_path, raw_labels[i], (long long)i,
                         (long long)(labels.header_bytes + (size_t)i), (long long)num_classes);
      goto err;
    }
  targets = ddp_alloc((size_t)n * sizeof *targets);
  if (!targets) {
    status = ddp_error(DDP_ERR_NOMEM, "dataset: cannot allocate %lld labels", (long long)n);
    goto err;
  }
  for (int64_t i = 0; i < n; i++) targets[i] = raw_labels[i];

  status = dataset_new(&ds, "idx");
  if (status != DDP_OK) goto err;
  ddp_dataset_info *info = &ds->info;
  info->num_samples = n;
  info->input_ndim = 3;
  info->input_shape[0] = 1; /* one channel, as torchvision's ToTensor gives */
  info->input_shape[1] = images.dims[1];
  info->input_shape[2] = images.dims[2];
  info->input_numel = images.dims[1] * images.dims[2];
  info->input_storage = DDP_UINT8;
  info->target_dtype = DDP_INT64;
  info->target_numel = 1;
  info->num_classes = num_classes;
  ds->kind = DDP__DATASET_STORED;
  ds->inputs = images.data; /* the dataset takes the pixel buffer over */
  ds->targets = targets;
  info->inputs = ds->inputs;
  info->targets = ds->targets;
  ddp_idx_free(&labels);
  *out = ds;
  return DDP_OK;

err:
  ddp_free(targets);
  ddp_idx_free(&images);
  ddp_idx_free(&labels);
  return status;
}

ddp_status ddp_dataset_open_idx(ddp_dataset **out, const char *images_path,
                                const char *labels_path, int64_t num_classes) {
  return open_idx(out, images_path, labels_path, num_classes, 0);
}

/* Finds the first of the candidate names in dir; *found is "" when none. */
static void find_first(const char *dir, const char *const *names, int count, char *found,
                       size_t bytes) {
  found[0] = '\0';
  for (int i = 0; i < count; i++) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, names[i]);
    if (access(path, F_OK) == 0) {
      snprintf(found, bytes, "%s", path);
      return;
    }
  }
}

ddp_status ddp_dataset_open_idx_dir(ddp_dataset **out, const char *dir, ddp_split split) {
  return ddp_dataset_open_idx_dir_first(out, dir, split, 0);
}

ddp_status ddp_dataset_open_idx_dir_first(ddp_dataset **out, const char *dir, ddp_split split,
                                          int64_t max_samples) {
  *out = NULL;
  if (max_samples < 0)
    return ddp_error(DDP_ERR_INVALID, "dataset: max_samples is %lld (0 for all, or more)",
                     (long long)max_samples);
  static const char *const train_images[] = {"train-images-idx3-ubyte.gz",
                                             "train-images-idx3-ubyte",
                                             "train-images.idx3-ubyte"};
  static const char *const train_labels[] = {"train-labels-idx1-ubyte.gz",
                                             "train-labels-idx1-ubyte",
                                             "train-labels.idx1-ubyte"};
  static const char *const test_images[] = {"t10k-images-idx3-ubyte.gz", "t10k-images-idx3-ubyte",
                                            "t10k-images.idx3-ubyte"};
  static const char *const test_labels[] = {"t10k-labels-idx1-ubyte.gz", "t10k-labels-idx1-ubyte",
                                            "t10k-labels.idx1-ubyte"};
  const bool train = split == DDP_SPLIT_TRAIN;
  const char *const *image_names = train ? train_images : test_images;
  const char *const *label_names = train ? train_labels : test_labels;
  const char *split_name = train ? "training" : "test";
  if (!dir || !*dir) return ddp_error(DDP_ERR_INVALID, "dataset: no directory given");

  struct stat st;
  if (stat(dir, &st) != 0) {
    int e = errno;
    return ddp_error(e == ENOENT || e == ENOTDIR ? DDP_ERR_NOTFOUND : DDP_ERR_IO,
                     "dataset: directory %s: %s (looking for the %s set: %s[.gz] and %s[.gz])",
                     dir, strerror(e), split_name, image_names[1], label_names[1]);
  }
  if (!S_ISDIR(st.st_mode))
    return ddp_error(DDP_ERR_INVALID, "dataset: %s is not a directory (looking for %s[.gz])", dir,
                     image_names[1]);
  char images[4096], labels[4096];
  find_first(dir, image_names, 3, images, sizeof images);
  if (!images[0])
    return ddp_error(DDP_ERR_NOTFOUND, "dataset: %s: no %s images: looked for %s, %s and %s",
                     dir, split_name, image_names[0], image_names[1], image_names[2]);
  find_first(dir, label_names, 3, labels, sizeof labels);
  if (!labels[0])
    return ddp_error(DDP_ERR_NOTFOUND, "dataset: %s: no %s labels: looked for %s, %s and %s",
                     dir, split_name, label_names[0], label_names[1], label_names[2]);
  DDP_TRY(open_idx(out, images, labels, 10, max_samples));

  /* Name it after the directory: "fashion-mnist train". */
  const char *base = dir + strlen(dir);
  while (base > dir && base[-1] == '/') base--;
  const char *end = base;
  while (base > dir && base[-1] != '/') base--;
  snprintf((*out)->name, sizeof (*out)->name, "%.*s %s", (int)(end - base), base,
           train ? "train" : "test");
  return DDP_OK;
}

/* ---- Synthetic data ------------------------------------------------------ */

ddp_status ddp_dataset_create_toydata(ddp_dataset **out, int64_t num_samples) {
  *out = NULL;
  if (num_samples < 1)
    return ddp_error(DDP_ERR_INVALID, "dataset: toydata needs num_samples >= 1, got %lld",
                     (long long)num_samples);
  ddp_dataset *ds = NULL;
  DDP_TRY(dataset_new(&ds, "toydata"));
  ddp_dataset_info *info = &ds->info;
  info->num_samples = num_samples;
  info->input_ndim = 1;
  info->input_shape[0] = TOYDATA_WIDTH;
  info->input_numel = TOYDATA_WIDTH;
  info->input_storage = DDP_FLOAT32;
  info->target_dtype = DDP_INT64;
  info->target_numel = 1;
  info->num_classes = 10;
  ds->kind = DDP__DATASET_TOYDATA;
  *out = ds;
  return DDP_OK;
}

ddp_status ddp_dataset_create_regression(ddp_dataset **out, int64_t num_samples,
                                         uint64_t seed) {
  *out = NULL;
  if (num_samples < 1 || num_samples > ((int64_t)1 << 32))
    return ddp_error(DDP_ERR_INVALID, "dataset: regression needs num_samples in [1, 2^32], got %lld",
                     (long long)num_samples);
  ddp_dataset *ds = NULL;
  DDP_TRY(dataset_new(&ds, "regression"));
  float *x = ddp_alloc((size_t)num_samples * REGRESSION_INPUTS * sizeof(float));
  float *y = ddp_alloc((size_t)num_samples * REGRESSION_TARGETS * sizeof(float));
  if (!x || !y) {
    ddp_free(x);
    ddp_free(y);
    ddp_dataset_destroy(ds);
    return ddp_error(DDP_ERR_NOMEM, "dataset: cannot allocate %lld regression samples",
                     (long long)num_samples);
  }
  /* Like the seed's torch.randn(N, 10) then torch.randn(N, 5): all inputs
   * first, then all targets, from one stream. */
  ddp_rng rng;
  ddp_rng_seed(&rng, seed);
  for (int64_t i = 0; i < num_samples * REGRESSION_INPUTS; i++) x[i] = ddp_rng_normal(&rng);
  for (int64_t i = 0; i < num_samples * REGRESSION_TARGETS; i++) y[i] = ddp_rng_normal(&rng);
  ddp_dataset_info *info = &ds->info;
  info->num_samples = num_samples;
  info->input_ndim = 1;
  info->input_shape[0] = REGRESSION_INPUTS;
  info->input_numel = REGRESSION_INPUTS;
  info->input_storage = DDP_FLOAT32;
  info->target_dtype = DDP_FLOAT32;
  info->target_numel = REGRESSION_TARGETS;
  info->num_classes = 0;
  ds->kind = DDP__DATASET_STORED;
  ds->inputs = x;
  ds->targets = y;
  info->inputs = x;
  info->targets = y;
  *out = ds;
  return DDP_OK;
}

/* ---- Access -------------------------------------------------------------- */

/* Rows this far ahead are requested from memory while the current one is
 * converted: shuffled rows are scattered over the dataset, so each one's
 * first line would otherwise be a full memory round trip. */
#define GATHER_PREFETCH_ROWS 4

static void prefetch_row(const ddp_dataset *ds, int64_t i) {
  const size_t bytes = (size_t)ds->info.input_numel * ddp_dtype_size(ds->info.input_storage);
  const uintptr_t start = (uintptr_t)ds->inputs + (uintptr_t)i * bytes, end = start + bytes;
  for (uintptr_t a = start & ~(uintptr_t)63; a < end; a += 64) __builtin_prefetch((void *)a);
}

void ddp__dataset_gather(const ddp_dataset *ds, const int64_t *indices, int64_t count,
                         const float *lut, float mean, float std, float *x, void *y) {
  const ddp_dataset_info *info = &ds->info;
  const int64_t width = info->input_numel, twidth = info->target_numel;
  const bool stored = ds->kind != DDP__DATASET_TOYDATA;
  for (int64_t s = 0; stored && s < GATHER_PREFETCH_ROWS && s < count; s++)
    prefetch_row(ds, indices[s]);
  for (int64_t s = 0; s < count; s++) {
    const int64_t i = indices[s];
    if (stored && s + GATHER_PREFETCH_ROWS < count)
      prefetch_row(ds, indices[s + GATHER_PREFETCH_ROWS]);
    float *xs = x + s * width;
    if (ds->kind == DDP__DATASET_TOYDATA) {
      const float v = ((float)i - mean) / std;
      for (int64_t k = 0; k < width; k++) xs[k] = v;
      ((int64_t *)y)[s] = i % 10;
      continue;
    }
    if (info->input_storage == DDP_UINT8) {
      const uint8_t *src = (const uint8_t *)ds->inputs + i * width;
      for (int64_t k = 0; k < width; k++) xs[k] = lut[src[k]];
    } else {
      const float *src = (const float *)ds->inputs + i * width;
      for (int64_t k = 0; k < width; k++) xs[k] = (src[k] - mean) / std;
    }
    if (info->target_dtype == DDP_INT64)
      memcpy((int64_t *)y + s * twidth, (const int64_t *)ds->targets + i * twidth,
             (size_t)twidth * sizeof(int64_t));
    else
      memcpy((float *)y + s * twidth, (const float *)ds->targets + i * twidth,
             (size_t)twidth * sizeof(float));
  }
}

ddp_status ddp_dataset_get(const ddp_dataset *ds, int64_t i, float *x, void *target) {
  if (i < 0 || i >= ds->info.num_samples)
    return ddp_error(DDP_ERR_RANGE, "dataset %s: index %lld outside [0, %lld)", ds->name,
                     (long long)i, (long long)ds->info.num_samples);
  float lut[256];
  for (int v = 0; v < 256; v++) lut[v] = (float)v / 255.0f;
  ddp__dataset_gather(ds, &i, 1, lut, 0.0f, 1.0f, x, target);
  return DDP_OK;
}
