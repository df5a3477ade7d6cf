/* ddp data: the IDX (MNIST) file reader, in-memory datasets (IDX directories
 * and two synthetic ones), samplers behind one interface, and a loader that
 * batches, converts and normalises samples on background threads.
 *
 * The model of use (PyTorch's DataLoader):
 *
 *   ddp_dataset *ds;
 *   DDP_TRY(ddp_dataset_open_idx_dir(&ds, "/usr/share/datasets/fashion-mnist",
 *                                    DDP_SPLIT_TRAIN));
 *   ddp_loader_config cfg = ddp_loader_defaults();
 *   cfg.batch_size = 100; cfg.shuffle = true; cfg.num_workers = 2;
 *   ddp_loader *loader;
 *   DDP_TRY(ddp_loader_create(&loader, ds, &cfg));
 *   for (int64_t epoch = 0; epoch < epochs; epoch++) {
 *     DDP_TRY(ddp_loader_start_epoch(loader, epoch));
 *     for (;;) {
 *       ddp_batch b;
 *       DDP_TRY(ddp_loader_next(loader, &b));
 *       if (b.size == 0) break;               // end of the epoch
 *       ... b.x (B,1,28,28) float32, b.y (B) int64 ...
 *     }
 *   }
 *   ddp_loader_destroy(loader);
 *   ddp_dataset_destroy(ds);
 *
 * Errors name the file and what was wrong, with the byte offset where one
 * applies (offsets in a .gz file count decompressed bytes). */
#ifndef DDP_DATA_H
#define DDP_DATA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ddp/core.h"
#include "ddp/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- IDX files -------------------------------------------------------------
 * The format of MNIST (http://yann.lecun.com/exdb/mnist/): two zero bytes, a
 * type code, the number of dimensions, then each dimension as a big-endian
 * uint32, then the elements in row-major order, big-endian. A file may be
 * gzip-compressed: it is recognised by its first two bytes (1f 8b), not by its
 * name. Every length is checked against the data before it is trusted: the
 * data must be exactly prod(dims) * element size bytes. */
typedef enum ddp_idx_type {
  DDP_IDX_UBYTE = 0x08,
  DDP_IDX_SBYTE = 0x09,
  DDP_IDX_SHORT = 0x0B,  /* int16 */
  DDP_IDX_INT = 0x0C,    /* int32 */
  DDP_IDX_FLOAT = 0x0D,  /* float32 */
  DDP_IDX_DOUBLE = 0x0E, /* float64 */
} ddp_idx_type;

#define DDP_IDX_MAX_DIMS 6

/* A whole IDX file in memory. `data` holds numel elements of `type` in host
 * byte order (converted from big-endian), 64-byte aligned; it belongs to the
 * struct and is released with ddp_idx_free. */
typedef struct ddp_idx {
  ddp_idx_type type;
  int32_t ndim;
  int64_t dims[DDP_IDX_MAX_DIMS];
  int64_t numel;        /* product of dims */
  size_t elem_size;     /* bytes per element */
  size_t header_bytes;  /* 4 + 4 * ndim: the offset of the first element */
  void *data;
} ddp_idx;

/* Reads the IDX file at `path` (plain or gzip) into *out. On failure *out is
 * zeroed and the status is DDP_ERR_NOTFOUND (no such file), DDP_ERR_IO (read
 * failure, or a gzip stream that is corrupted or cut short) or DDP_ERR_FORMAT
 * (bad magic, unknown type code, more than DDP_IDX_MAX_DIMS dimensions,
 * truncated header or data, trailing bytes, dimensions whose product
 * overflows); the message starts "idx: <path>: " and gives the offset. */
ddp_status ddp_idx_read(const char *path, ddp_idx *out);
/* The same, keeping only the first max_items along dimension 0 (0, or at
 * least dims[0]: all of them): only those are read and decompressed, and
 * what follows them is neither read nor checked (a file cut short after
 * them reads fine). dims[0] and numel describe what was kept. */
ddp_status ddp_idx_read_first(const char *path, int64_t max_items, ddp_idx *out);
/* Releases out->data and zeroes *out; NULL ok. */
void ddp_idx_free(ddp_idx *idx);
/* "unsigned byte", "float", ...; "unknown" for other codes. */
const char *ddp_idx_type_name(int type_code);
/* Bytes per element of a type code; 0 for an unknown code. */
size_t ddp_idx_type_size(int type_code);

/* ---- Datasets --------------------------------------------------------------
 * A dataset is num_samples samples held in memory, each an input of a fixed
 * shape (delivered as float32) and a target: an int64 class label in
 * [0, num_classes) or a float32 vector. IDX pixels stay uint8 in memory (the
 * Fashion-MNIST training set is 47 MB) and are converted per batch. */
typedef enum ddp_split {
  DDP_SPLIT_TRAIN = 0,
  DDP_SPLIT_TEST = 1,
} ddp_split;

typedef struct ddp_dataset ddp_dataset;

typedef struct ddp_dataset_info {
  const char *name;                   /* "fashion-mnist train", "toydata", ... */
  int64_t num_samples;
  int32_t input_ndim;                 /* per sample, e.g. 3 for (1, 28, 28) */
  int64_t input_shape[DDP_MAX_DIMS];
  int64_t input_numel;                /* elements per sample, e.g. 784 */
  ddp_dtype input_storage;            /* DDP_UINT8 (delivered as v/255) or DDP_FLOAT32 */
  ddp_dtype target_dtype;             /* DDP_INT64 (class labels) or DDP_FLOAT32 */
  int64_t target_numel;               /* elements per target: 1 for a label */
  int64_t num_classes;                /* 0 when targets are float vectors */
  /* The stored data, or NULL where samples are generated on demand (toydata):
   * inputs: num_samples * input_numel elements of input_storage; targets:
   * num_samples * target_numel elements of target_dtype. */
  const void *inputs;
  const void *targets;
} ddp_dataset_info;

/* Opens the MNIST-format dataset in `dir`: for DDP_SPLIT_TRAIN the first of
 * train-images-idx3-ubyte.gz, train-images-idx3-ubyte, train-images.idx3-ubyte
 * that exists (and likewise train-labels-idx1-ubyte...), for DDP_SPLIT_TEST
 * the t10k-* files. Both Fashion-MNIST and MNIST use these names. Validates
 * that the images are (N, H, W) unsigned bytes, the labels (N) unsigned bytes
 * with the same N, and every label < 10 (an error names the file, the index,
 * the value and its offset). A missing directory or file is DDP_ERR_NOTFOUND
 * naming the path and the names looked for. The caller destroys *out. */
ddp_status ddp_dataset_open_idx_dir(ddp_dataset **out, const char *dir, ddp_split split);
/* The same with only the first max_samples samples (0: all; more than the
 * files hold: all), decoding only those (ddp_idx_read_first): the result of
 * ddp_dataset_open_idx_dir and ddp_dataset_truncate(max_samples) without
 * decompressing the rest (ddp-hpo's reduced budgets: 2,000 of the 60,000
 * training images in 20 ms instead of 0.6 s). */
ddp_status ddp_dataset_open_idx_dir_first(ddp_dataset **out, const char *dir, ddp_split split,
                                          int64_t max_samples);
/* The same from two explicit files. `num_classes` bounds the labels (10 for
 * MNIST). */
ddp_status ddp_dataset_open_idx(ddp_dataset **out, const char *images_path,
                                const char *labels_path, int64_t num_classes);
/* The seed's ToyData: sample i is 32 copies of (float)i, label i mod 10.
 * Generated on demand, so it costs no memory. The seed uses 1 << 20 samples. */
ddp_status ddp_dataset_create_toydata(ddp_dataset **out, int64_t num_samples);
/* The seed's regression data: inputs of 10 and targets of 5, each element
 * standard normal, from `seed` (the same seed gives the same data). */
ddp_status ddp_dataset_create_regression(ddp_dataset **out, int64_t num_samples,
                                         uint64_t seed);
/* NULL ok. */
void ddp_dataset_destroy(ddp_dataset *ds);
/* Valid while the dataset lives. */
const ddp_dataset_info *ddp_dataset_get_info(const ddp_dataset *ds);
int64_t ddp_dataset_size(const ddp_dataset *ds);
/* Keeps only the first n samples (n >= 1; more than the dataset has leaves
 * it whole): a quick run on a prefix of the data, as PyTorch's
 * Subset(ds, range(n)). The memory stays the dataset's. */
ddp_status ddp_dataset_truncate(ddp_dataset *ds, int64_t n);
/* Sample i as the loader delivers it without normalisation: x gets
 * input_numel floats (uint8 pixels as v / 255.0f, as torchvision's ToTensor),
 * target gets target_numel elements of target_dtype. DDP_ERR_RANGE if i is
 * outside [0, num_samples). */
ddp_status ddp_dataset_get(const ddp_dataset *ds, int64_t i, float *x, void *target);

/* ---- Samplers --------------------------------------------------------------
 * A sampler decides the order in which one epoch visits the dataset (and, for
 * the distributed sampler, which part of it this rank visits). It is a table
 * of functions behind a handle, so new kinds plug into the loader:
 *   set_epoch(epoch)  chooses the epoch (random orders are seeded per epoch);
 *   length()          indices per epoch, the same for every epoch;
 *   fill(indices)     writes the epoch's length() indices, each in [0, N).
 * None of them may allocate: the loader calls them between epochs of a
 * training loop that allocates nothing. */
typedef struct ddp_sampler ddp_sampler;

typedef struct ddp_sampler_ops {
  const char *name; /* "sequential", "random", ... */
  void (*set_epoch)(ddp_sampler *sampler, int64_t epoch);
  int64_t (*length)(const ddp_sampler *sampler);
  ddp_status (*fill)(ddp_sampler *sampler, int64_t *indices);
  void (*destroy)(ddp_sampler *sampler); /* frees the sampler itself */
} ddp_sampler_ops;

/* The handle every sampler starts with; implementations embed it as their
 * first member and keep their own state after it. */
struct ddp_sampler {
  const ddp_sampler_ops *ops;
};

/* 0, 1, ..., num_samples - 1 every epoch. */
ddp_status ddp_sampler_create_sequential(ddp_sampler **out, int64_t num_samples);
/* PyTorch's RandomSampler(data, generator=g) with g = torch.Generator() and
 * g.manual_seed(seed) done once, iterated once per epoch: index for index
 * the order PyTorch 1.13 gives in epoch e. (Each pass of RandomSampler draws
 * two randperms from g, the second for a remainder of zero elements; ddp
 * skips over that one too. RandomSampler without a generator seeds a fresh
 * one per pass from torch's global generator; ddp takes the seed
 * explicitly.) Any epoch may be asked for in any order: the next one in
 * order continues the stream, a jump skips 2 e (num_samples - 1) outputs. */
ddp_status ddp_sampler_create_random(ddp_sampler **out, int64_t num_samples, uint64_t seed);

/* torch.randperm(n, generator=torch.Generator().manual_seed(seed)) into
 * out[0..n): the MT19937 generator of PyTorch's CPU generator (which uses
 * the low 32 bits of the seed) and randperm's shuffle of torch 1.13. */
ddp_status ddp_randperm(int64_t n, uint64_t seed, int64_t *out);

/* ---- Distributed samplers ----------------------------------------------------
 * torch.utils.data.distributed.DistributedSampler, index order included:
 * each epoch takes the whole order (torch.randperm(N) from a generator seeded
 * with seed + epoch when shuffling, else 0..N-1), pads it by repeating it
 * from the start up to total_size = length * num_replicas (as often as
 * needed, so also when N < num_replicas) or, with drop_last, cuts it to
 * total_size, and gives rank the elements rank, rank + num_replicas, ...
 * length is ceil(N / num_replicas), or with drop_last (when N is not
 * divisible) ceil((N - num_replicas) / num_replicas), 0 when N < num_replicas.
 * Every rank has the same length, so ranks take the same number of steps.
 * The epoch comes from ddp_sampler_set_epoch (the loader's start_epoch calls
 * it), as sampler.set_epoch(epoch) does in PyTorch: without it every epoch
 * would repeat the same order. Start from
 * ddp_distributed_sampler_defaults(num_replicas, rank). */
typedef struct ddp_distributed_sampler_options {
  int64_t num_replicas; /* world size, >= 1 */
  int64_t rank;         /* in [0, num_replicas) */
  bool shuffle;         /* default true, as in PyTorch */
  uint64_t seed;        /* default 0; the same on every rank */
  bool drop_last;       /* default false: pad instead */
  int64_t reserved[4];
} ddp_distributed_sampler_options;
DDP_STRUCT_SIZE(ddp_distributed_sampler_options, 72);

/* The options for (num_replicas, rank) with PyTorch's defaults. */
ddp_distributed_sampler_options ddp_distributed_sampler_defaults(int64_t num_replicas,
                                                                 int64_t rank);
/* Allocates the order of num_samples indices once (shuffle only), so filling
 * an epoch allocates nothing. Bad options are DDP_ERR_INVALID naming them. */
ddp_status ddp_sampler_create_distributed(ddp_sampler **out, int64_t num_samples,
                                          const ddp_distributed_sampler_options *options);
/* For evaluation: rank gets rank, rank + num_replicas, ... < num_samples, in
 * order, with no padding and nothing dropped, so across the ranks every
 * sample is visited exactly once and sums reduced over ranks count the test
 * set once. Lengths differ by at most one between ranks (ceil((num_samples -
 * rank) / num_replicas)): an evaluation loop must not run a collective per
 * batch, only once at the end (or use join). */
ddp_status ddp_sampler_create_distributed_eval(ddp_sampler **out, int64_t num_samples,
                                               int64_t num_replicas, int64_t rank);
/* Resuming epoch `epoch` at another world size (elastic training): an earlier
 * run consumed the first `consumed` positions of that epoch's order (steps x
 * its global batch); this sampler deals out the rest over its own world, so
 * across the two runs every sample of the epoch is seen once (but the
 * padding's repeats, as in PyTorch). In that epoch rank's k-th index is
 * position consumed + rank + k num_replicas of the extended order, k <
 * ceil((N - consumed) / num_replicas) (its length for that epoch; 0 once
 * consumed >= N); other epochs are untouched. With consumed a multiple of
 * num_replicas this is exactly the uninterrupted epoch's tail.
 * DDP_ERR_INVALID unless sampler is ddp_sampler_create_distributed's;
 * DDP_ERR_UNSUPPORTED with drop_last. */
ddp_status ddp_sampler_distributed_resume(ddp_sampler *sampler, int64_t epoch, int64_t consumed);
void ddp_sampler_set_epoch(ddp_sampler *sampler, int64_t epoch);
int64_t ddp_sampler_length(const ddp_sampler *sampler);
ddp_status ddp_sampler_fill(ddp_sampler *sampler, int64_t *indices);
/* NULL ok. */
void ddp_sampler_destroy(ddp_sampler *sampler);

/* ---- The loader ------------------------------------------------------------
 * Delivers batches of batch_size samples in sampler order. With num_workers
 * > 0, that many background threads fill a ring of `prefetch` batch buffers
 * ahead of the consumer; with 0, ddp_loader_next fills the batch on the
 * caller's thread. The output is the same either way. All buffers are
 * allocated by ddp_loader_create: starting an epoch and taking batches
 * allocate nothing. */
typedef struct ddp_loader ddp_loader;

/* Start from ddp_loader_defaults(), then set what you need. */
typedef struct ddp_loader_config {
  int64_t batch_size;   /* > 0 */
  bool shuffle;         /* random sampler (seeded) instead of sequential */
  bool drop_last;       /* drop the last batch when it is smaller than batch_size */
  int num_workers;      /* background threads; 0 = fill on the caller's thread */
  int prefetch;         /* batch buffers in the ring (>= 1); 0 = 2 * num_workers + 1 */
  uint64_t seed;        /* for shuffle */
  /* Optional normalisation after the uint8 scale: x = (x - mean) / std, as
   * torchvision's Normalize((mean,), (std,)). */
  bool normalize;
  float mean;
  float std;
  /* When not NULL, this sampler decides the order (shuffle and seed are
   * ignored); the loader borrows it, the caller destroys it after the loader. */
  ddp_sampler *sampler;
  /* Longest ddp_loader_next waits for a batch before DDP_ERR_TIMEOUT. */
  double timeout_s;
  int64_t reserved[8];
} ddp_loader_config;
DDP_STRUCT_SIZE(ddp_loader_config, 128);

/* batch_size 1, no shuffle, no drop_last, no workers, seed 0, no
 * normalisation, no sampler, timeout 60 s. */
ddp_loader_config ddp_loader_defaults(void);

/* One batch: views into the loader's buffers, valid until the next
 * ddp_loader_next, ddp_loader_start_epoch or ddp_loader_destroy. */
typedef struct ddp_batch {
  int64_t size;           /* samples in this batch (the last may be short); 0 = epoch over */
  int64_t index;          /* batch number within the epoch, from 0 */
  ddp_tensor x;           /* (size, input_shape...) float32 */
  ddp_tensor y;           /* (size) int64 labels, or (size, target_numel) float32 */
  const int64_t *indices; /* the dataset indices of the samples, size of them */
} ddp_batch;

/* Creates a loader over `ds` (borrowed: it must outlive the loader). Starts
 * the worker threads; no epoch is running until ddp_loader_start_epoch. */
ddp_status ddp_loader_create(ddp_loader **out, const ddp_dataset *ds,
                             const ddp_loader_config *config);
/* Starts epoch `epoch` (sets the sampler's epoch, takes its order, and lets
 * the workers begin). May be called at any time, also in the middle of an
 * epoch: batches of the old epoch are abandoned. */
ddp_status ddp_loader_start_epoch(ddp_loader *loader, int64_t epoch);
/* The next batch of the running epoch into *batch; batch->size == 0 once the
 * epoch is over. DDP_ERR_STATE before the first ddp_loader_start_epoch,
 * DDP_ERR_TIMEOUT when no batch arrives within config.timeout_s. */
ddp_status ddp_loader_next(ddp_loader *loader, ddp_batch *batch);
/* Batches per epoch: ceil(length / batch_size), or floor with drop_last. */
int64_t ddp_loader_num_batches(const ddp_loader *loader);
/* Samples per epoch (the sampler's length). */
int64_t ddp_loader_num_samples(const ddp_loader *loader);
/* Stops and joins the workers (also in the middle of an epoch) and frees
 * everything the loader allocated. NULL ok. */
void ddp_loader_destroy(ddp_loader *loader);

#ifdef __cplusplus
}
#endif
#endif /* DDP_DATA_H */
