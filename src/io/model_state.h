/* The model's state dict for the checkpoint code: its entries as safetensors
 * entries, and load_state_dict split into a check (everything that can fail)
 * and an apply (copies only), so a checkpoint load can check the model and
 * the training state before it changes either. */
#ifndef DDP_IO_MODEL_STATE_H
#define DDP_IO_MODEL_STATE_H

#include "ddp/io.h"

/* The model's state entries in state_dict order; data points into the
 * model, or, for a model on a GPU, into host copies made in the same
 * allocation. The caller frees *out with ddp_free. */
ddp_status ddp__model_state_entries(const ddp_model *model, ddp_safetensors_entry **out,
                                    int *count);
/* Strict load check: names (a "module." prefix accepted), dtypes, shapes. */
ddp_status ddp__model_state_check(const ddp_model *model, const ddp_safetensors *st);
/* Copies every tensor (to a GPU model's device, waiting for the copies);
 * only after a successful check. Fails only when the device does. */
ddp_status ddp__model_state_apply(ddp_model *model, const ddp_safetensors *st);

#endif /* DDP_IO_MODEL_STATE_H */
