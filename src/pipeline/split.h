/* The stage split (split.c): a model's top-level modules, boundaries from
 * names or measured cost, a copy of some modules as a model of its own, and
 * running a range of modules. Internal to the pipeline layer. */
#ifndef DDP__PIPELINE_SPLIT_H
#define DDP__PIPELINE_SPLIT_H

#include "ddp/nn.h"

/* The root's children in forward order (forward_order when set) into
 * out[0..max); returns how many there are (may exceed max). */
int ddp__pp_top_modules(ddp_model *model, ddp_module **out, int max);
const char *ddp__pp_module_name(const ddp_module *m);
/* Boundaries from "a,b,c": bounds[g] is stage g's first module (index into
 * mods), bounds[n_stages] = n_mods. DDP_ERR_INVALID naming the module and
 * listing the valid names. */
ddp_status ddp__pp_split_names(ddp_module *const *mods, int n_mods, const char *spec,
                               int n_stages, int *bounds);
/* Each top-level module's forward + backward seconds (fastest of 3) on
 * `rows` rows of random input of the sample shape, on a copy of the model. */
ddp_status ddp__pp_profile(ddp_model *model, ddp_module *const *mods, int n_mods, int ndim,
                           const int64_t *sample, int64_t rows, double *cost);
/* The contiguous split of n_mods costs into n_stages non-empty stages that
 * minimises the most expensive stage. */
ddp_status ddp__pp_balance(const double *cost, int n_mods, int n_stages, int *bounds);
/* A new finalized model holding the root children i of src with keep[i]
 * (registration order), their names, parameter and buffer values, loss,
 * mode and dropout generator. */
ddp_status ddp__pp_clone(ddp_model *src, const bool *keep, ddp_model **out);
/* m's index among the root's children in registration order, or -1. */
int ddp__pp_registration_index(ddp_model *model, const ddp_module *m);
/* The root child named `name`, or NULL. */
ddp_module *ddp__pp_find_top(ddp_model *model, const char *name);
/* Runs mods[0..n) of `model` in turn on x. */
ddp_status ddp__pp_run_modules(ddp_model *model, ddp_module *const *mods, int n, ddp_tape *tape,
                               ddp_tensor *x, ddp_tensor **out);

#endif /* DDP__PIPELINE_SPLIT_H */
