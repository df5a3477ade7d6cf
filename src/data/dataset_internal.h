/* Internal view of a dataset, shared by dataset.c and loader.c: the loader
 * converts straight from the stored arrays into its batch buffers. */
#ifndef DDP_DATA_DATASET_INTERNAL_H
#define DDP_DATA_DATASET_INTERNAL_H

#include "ddp/data.h"

typedef enum ddp__dataset_kind {
  DDP__DATASET_STORED = 0, /* inputs and targets in memory (IDX, regression) */
  DDP__DATASET_TOYDATA = 1 /* generated from the index */
} ddp__dataset_kind;

struct ddp_dataset {
  ddp_dataset_info info;
  ddp__dataset_kind kind;
  char name[64];
  void *inputs;  /* owned; num_samples * input_numel of info.input_storage */
  void *targets; /* owned; num_samples * target_numel of info.target_dtype */
};

/* Writes samples indices[0..count) into x (count * input_numel floats) and
 * y (count * target_numel of target_dtype). A stored uint8 v becomes lut[v]
 * (256 floats: (v / 255.0f - mean) / std, precomputed); a float input v
 * becomes (v - mean) / std (mean 0, std 1 leave it exact). Indices must be in
 * range (the loader checks them once per epoch). */
void ddp__dataset_gather(const ddp_dataset *ds, const int64_t *indices, int64_t count,
                         const float *lut, float mean, float std, float *x, void *y);

#endif /* DDP_DATA_DATASET_INTERNAL_H */
