/* The one place a trainer's strategy is chosen (docs/train.md,
 * "Strategies"): the tables by ddp_train_strategy, AUTO resolved from the
 * options and the group, and an explicit choice checked against them. A new
 * strategy is a table in a file of its own (strategy_<name>.c), a value of
 * ddp_train_strategy and a row here. */
#include "train/train_internal.h"

static const ddp__train_strategy_ops *const strategies[] = {
    [DDP_TRAIN_SINGLE] = &ddp__train_single,
    [DDP_TRAIN_DATA_PARALLEL] = &ddp__train_data_parallel,
    [DDP_TRAIN_PIPELINE] = &ddp__train_pipeline,
    [DDP_TRAIN_PARAM_SERVER] = &ddp__train_param_server,
    [DDP_TRAIN_ZERO] = &ddp__train_zero,
};

#define N_STRATEGIES ((int)(sizeof strategies / sizeof strategies[0]))

ddp_status ddp__train_strategy_choose(const ddp_train_options *o, const ddp_process_group *pg,
                                      const ddp__train_strategy_ops **out) {
  *out = NULL;
  if ((int)o->strategy < DDP_TRAIN_AUTO || (int)o->strategy >= N_STRATEGIES)
    return ddp_error(DDP_ERR_INVALID, "unknown strategy %d", (int)o->strategy);
  if (o->pipeline && o->param_server)
    return ddp_error(DDP_ERR_INVALID,
                     "options.pipeline and options.param_server are two strategies (pipeline, "
                     "param_server); set one");
  ddp_train_strategy kind = o->strategy;
  if (kind == DDP_TRAIN_AUTO)
    kind = o->pipeline       ? DDP_TRAIN_PIPELINE
           : o->param_server ? DDP_TRAIN_PARAM_SERVER
           : o->zero_stage   ? DDP_TRAIN_ZERO
           : pg              ? DDP_TRAIN_DATA_PARALLEL
                             : DDP_TRAIN_SINGLE;
  const ddp__train_strategy_ops *ops = strategies[kind];
  DDP_ASSERT(ops && ops->kind == kind);
  if (o->pipeline && kind != DDP_TRAIN_PIPELINE)
    return ddp_error(DDP_ERR_INVALID,
                     "strategy %s contradicts options.pipeline (the pipeline is a strategy of "
                     "its own, data parallel across replicas): leave strategy at auto or set "
                     "DDP_TRAIN_PIPELINE",
                     ops->name);
  if (o->param_server && kind != DDP_TRAIN_PARAM_SERVER)
    return ddp_error(DDP_ERR_INVALID,
                     "strategy %s contradicts options.param_server (the parameter server is a "
                     "strategy of its own): leave strategy at auto or set "
                     "DDP_TRAIN_PARAM_SERVER",
                     ops->name);
  if (o->zero_stage && kind != DDP_TRAIN_ZERO)
    return ddp_error(DDP_ERR_INVALID,
                     "strategy %s contradicts options.zero_stage %d (ZeRO is a strategy of its "
                     "own, over a group): leave strategy at auto or set DDP_TRAIN_ZERO",
                     ops->name, (int)o->zero_stage);
  if (kind == DDP_TRAIN_PIPELINE && !o->pipeline)
    return ddp_error(DDP_ERR_INVALID,
                     "strategy pipeline needs options.pipeline (its stages and schedule)");
  if (kind == DDP_TRAIN_PARAM_SERVER && !o->param_server)
    return ddp_error(DDP_ERR_INVALID, "strategy param_server needs options.param_server (the "
                                      "trainer's client of the servers)");
  *out = ops;
  return DDP_OK;
}
