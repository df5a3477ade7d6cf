/* ddp: distributed data-parallel training in C. Include this for everything. */
#ifndef DDP_H
#define DDP_H

#include "ddp/core.h"
#include "ddp/tensor.h"
#include "ddp/data.h"
#include "ddp/nn.h"
#include "ddp/store.h"
#include "ddp/rendezvous.h"
#include "ddp/comm.h"
#include "ddp/optim.h"
#include "ddp/io.h"
#include "ddp/launch.h"
#include "ddp/parallel.h"
#include "ddp/zero.h"
#include "ddp/pipeline.h"
#include "ddp/rpc.h"
#include "ddp/rpc_autograd.h"
#include "ddp/ps.h"
#include "ddp/train.h"
#include "ddp/hpo.h"
#include "ddp/tensorboard.h"

#endif /* DDP_H */
