/* The executor: runs this rank's action list of a schedule for one batch.
 * Receives are posted where the list says (one compute early, so they
 * arrive while the previous compute runs) into buffers taken from pools
 * sized at setup; a forward or backward waits only for its own input; sends
 * are waited for only when their buffer is taken again. Time spent in those
 * waits is the stage's idle time. A failure aborts this rank's channels, so
 * every other stage fails within moments, each naming the stage that failed
 * first (pipeline_internal.h: the failure notice). */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "pipeline/stage.h"
#include "tensor/tape.h"

static int chunk_of(const ddp_pipeline *pp, int stage) { return stage / pp->p; }

/* ---- Failure ---------------------------------------------------------------------- */

static bool is_comm_failure(ddp_status s) {
  return s == DDP_ERR_PEER || s == DDP_ERR_ABORTED || s == DDP_ERR_TIMEOUT || s == DDP_ERR_CLOSED;
}

/* Makes the pipeline unusable, tells the other stages (the notice, then the
 * abort of this rank's channels) and returns the error to report. `blame`
 * is the stage held responsible (this rank's own, or the peer's of a failed
 * transfer). */
static ddp_status fail(ddp_pipeline *pp, ddp_status s, int stage, int blame) {
  char mine[1024], first[1024];
  int blame_rank = ddp__pp_rank_of(pp->p, blame);
  if (blame == stage)
    snprintf(mine, sizeof mine, "stage %d (rank %d) failed: %s", stage, pp->rank,
             ddp_last_error());
  else
    snprintf(mine, sizeof mine, "stage %d (rank %d) died or failed (seen by stage %d on rank %d): %s",
             blame, blame_rank, stage, pp->rank, ddp_last_error());
  ddp__pp_record_failure(pp->channels, mine, first, sizeof first);
  ddp__pp_channels_abort(pp->channels);
  pp->failed = true;
  snprintf(pp->failure, sizeof pp->failure, "%s", first);
  return ddp_error(s, "pipeline stage %d (rank %d): step failed: %s", stage, pp->rank, first);
}

/* Waits for a transfer (counting the time as idle) and frees its handle. */
static ddp_status wait_xfer(ddp_pipeline *pp, ddp_work **work, const char *what, int stage,
                            int mb, int peer_stage) {
  if (!*work) return DDP_OK;
  int64_t t0 = ddp_time_ns();
  double timeout = pp->options.timeout_s > 0 ? pp->options.timeout_s : -1.0;
  ddp_status s = ddp_work_wait(*work, timeout);
  pp->wait_ns += ddp_time_ns() - t0;
  ddp_work_free(*work);
  *work = NULL;
  if (s == DDP_OK) return DDP_OK;
  char of[32] = "";
  if (mb >= 0) snprintf(of, sizeof of, " of micro-batch %d", mb);
  ddp_error_wrap(s, "%s%s between stage %d (rank %d) and stage %d (rank %d), on their two-rank "
                 "channel", what, of, stage, pp->rank, peer_stage,
                 ddp__pp_rank_of(pp->p, peer_stage));
  return fail(pp, s, stage, is_comm_failure(s) ? peer_stage : stage);
}

/* ---- Pools ----------------------------------------------------------------------- */

/* A free slot, after the transfer that last used it completed. */
static ddp_status take_slot(ddp_pipeline *pp, pp_slot *pool, int n, int stage, int peer_stage,
                            int *index) {
  for (int i = 0; i < n; i++) {
    if (pool[i].busy) continue;
    DDP_TRY(wait_xfer(pp, &pool[i].work, "an earlier transfer", stage, -1, peer_stage));
    pool[i].busy = true;
    *index = i;
    return DDP_OK;
  }
  DDP_ASSERT(!"pipeline: a slot pool is smaller than the schedule needs");
  return DDP_ERR_INTERNAL;
}

static ddp_status take_tape(ddp_pipeline *pp, pp_chunk *c, int *index) {
  for (int i = 0; i < c->n_tapes; i++) {
    pp_tape *t = &c->tapes[i];
    if (t->busy) continue;
    DDP_TRY(wait_xfer(pp, &t->send, "an earlier send of activations", c->stage, -1, c->stage + 1));
    ddp_tape_reset(t->tape);
    t->busy = true;
    *index = i;
    return DDP_OK;
  }
  DDP_ASSERT(!"pipeline: the tape pool is smaller than the schedule needs");
  return DDP_ERR_INTERNAL;
}

/* ---- Actions --------------------------------------------------------------------- */

typedef struct {
  bool training;
  const ddp_tensor *input, *target;
  ddp_tensor *output;
  double loss_sum;  /* training: sum of losses; eval: sum of loss * rows */
  bool have_loss;
  bool losses_pending; /* on a GPU: pp->loss_host[mb] still on their way back */
} run_args;

/* n floats of zero at p, on the stages' device. */
static void zero_floats(ddp_pipeline *pp, float *p, int64_t n) {
  if (pp->device.type == DDP_DEVICE_CPU)
    memset(p, 0, (size_t)n * sizeof(float));
  else
    ddp__basic_kernels_for(pp->device)->fill(p, 0.0f, n);
}

static ddp_status post(ddp_pipeline *pp, bool send, int kind, int peer, void *buf, size_t bytes,
                       ddp_work **work, int stage, int mb, int peer_stage, const char *what) {
  ddp_status s = ddp__pp_post(pp->channels, send, kind, peer, buf, bytes, work);
  if (s == DDP_OK) return DDP_OK;
  ddp_error_wrap(s, "posting the %s of micro-batch %d", what, mb);
  return fail(pp, s, stage, is_comm_failure(s) ? peer_stage : stage);
}

static ddp_status view_rows(ddp_tensor *t, const ddp_tensor *of, int64_t off, int64_t rows) {
  int64_t shape[DDP_MAX_DIMS];
  memcpy(shape, of->shape, sizeof shape);
  int64_t row = of->shape[0] ? of->numel / of->shape[0] : 0;
  shape[0] = rows;
  DDP_TRY(ddp_tensor_wrap(t, of->dtype, of->ndim, shape,
                          (char *)of->data + (size_t)(off * row) * ddp_dtype_size(of->dtype)));
  t->device = of->device;
  return DDP_OK;
}

static ddp_status forward(ddp_pipeline *pp, run_args *a, const ddp_pipeline_action *act) {
  int g = act->stage, mb = act->microbatch;
  pp_chunk *c = &pp->chunks[chunk_of(pp, g)];
  int64_t rows = pp->rows[mb], off = pp->offsets[mb];
  int ti;
  DDP_TRY(take_tape(pp, c, &ti));
  c->tape_of[mb] = ti;
  ddp_tape *tape = c->tapes[ti].tape;
  ddp_tape_set_grad_enabled(tape, a->training);
  ddp_tensor *x = &c->inputs[mb];
  ddp_status s;
  if (g == 0) {
    s = view_rows(x, a->input, off, rows);
    if (s == DDP_OK && a->training && (a->input->flags & DDP_TENSOR_REQUIRES_GRAD) &&
        a->input->grad) {
      /* An input that requires grad (layers before the pipeline feed it)
       * gets its gradient: each micro-batch's rows of input->grad, added
       * into as a leaf's are. */
      x->grad = a->input->grad + off * (x->numel / rows);
      x->flags |= DDP_TENSOR_REQUIRES_GRAD;
    }
  } else {
    pp_slot *slot = &c->acts[c->act_of[mb]];
    DDP_TRY(wait_xfer(pp, &slot->work, "the receive of activations", g, mb, g - 1));
    int64_t shape[DDP_MAX_DIMS];
    shape[0] = rows;
    memcpy(shape + 1, c->in_shape, sizeof(int64_t) * (size_t)c->in_ndim);
    s = ddp_tensor_wrap(x, DDP_FLOAT32, c->in_ndim + 1, shape, slot->data);
    x->device = pp->device;
    if (s == DDP_OK && a->training) {
      /* The input's gradient lands in the slot's own buffer, which goes
       * back to the previous stage; backward adds into it, so it starts at
       * zero. */
      zero_floats(pp, slot->grad, x->numel);
      x->grad = slot->grad;
      x->flags |= DDP_TENSOR_REQUIRES_GRAD;
    }
  }
  ddp_tensor *out = NULL;
  if (s == DDP_OK) s = ddp__pp_run_modules(pp->model, c->mods, c->n_mods, tape, x, &out);
  if (s != DDP_OK) {
    ddp_error_wrap(s, "forward of micro-batch %d", mb);
    return fail(pp, s, g, g);
  }
  c->outputs[mb] = out;
  bool last = g == pp->n_stages - 1;
  if (last && a->target) {
    ddp_tensor *y = &c->targets[mb], *loss;
    s = view_rows(y, a->target, off, rows);
    if (s == DDP_OK) s = ddp_model_loss(pp->model, tape, out, y, &loss);
    if (s != DDP_OK) {
      ddp_error_wrap(s, "loss of micro-batch %d", mb);
      return fail(pp, s, g, g);
    }
    c->losses[mb] = loss;
    if (loss->device.type == DDP_DEVICE_CPU) {
      double value = ddp_tensor_f32(loss)[0];
      a->loss_sum += a->training ? value : value * (double)rows;
    } else {
      /* Read after the schedule (one wait for the device, not one per
       * micro-batch): the host goes on queueing the next work. */
      s = ddp_device_copy_async(DDP_CPU, &pp->loss_host[mb], loss->device, loss->data,
                                sizeof(float));
      if (s != DDP_OK) {
        ddp_error_wrap(s, "copying the loss of micro-batch %d back", mb);
        return fail(pp, s, g, g);
      }
      a->losses_pending = true;
    }
    a->have_loss = true;
  }
  if (last && a->output) {
    /* The caller's output is host memory (a copy back waits for the device). */
    float *dst = (float *)a->output->data + off * c->out_row;
    size_t bytes = (size_t)(rows * c->out_row) * sizeof(float);
    if (out->device.type == DDP_DEVICE_CPU)
      memcpy(dst, out->data, bytes);
    else if ((s = ddp_device_copy(DDP_CPU, dst, out->device, out->data, bytes)) != DDP_OK) {
      ddp_error_wrap(s, "copying the output of micro-batch %d back", mb);
      return fail(pp, s, g, g);
    }
  }
  if (a->training) {
    /* Activations held now: every tape still waiting for its backward. */
    int64_t held = 0, one = (int64_t)ddp__tape_arena(tape)->used_total;
    int live = 0;
    for (int ci = 0; ci < pp->v; ci++)
      for (int i = 0; i < pp->chunks[ci].n_tapes; i++)
        if (pp->chunks[ci].tapes[i].busy) {
          held += (int64_t)ddp__tape_arena(pp->chunks[ci].tapes[i].tape)->used_total;
          live++;
        }
    if (held > pp->stats.activation_bytes_high_water) pp->stats.activation_bytes_high_water = held;
    if (one > pp->stats.microbatch_activation_bytes) pp->stats.microbatch_activation_bytes = one;
    if (live > pp->stats.live_high_water) pp->stats.live_high_water = live;
  } else {
    if (g > 0) c->acts[c->act_of[mb]].busy = false;
    if (last) c->tapes[ti].busy = false;
  }
  return DDP_OK;
}

static ddp_status backward(ddp_pipeline *pp, const ddp_pipeline_action *act) {
  int g = act->stage, mb = act->microbatch;
  pp_chunk *c = &pp->chunks[chunk_of(pp, g)];
  pp_tape *t = &c->tapes[c->tape_of[mb]];
  ddp_status s = DDP_OK;
  if (g == pp->n_stages - 1) {
    /* d(scale * loss): PyTorch's loss / M for a mean over micro-batches. */
    s = ddp__backward_from(t->tape, c->losses[mb], &pp->scale);
  } else {
    pp_slot *slot = &c->grads[c->grad_of[mb]];
    DDP_TRY(wait_xfer(pp, &slot->work, "the receive of gradients", g, mb, g + 1));
    ddp_tensor *out = c->outputs[mb];
    /* A first stage without parameters has nothing to differentiate. */
    if (out->flags & DDP_TENSOR_REQUIRES_GRAD) s = ddp__backward_from(t->tape, out, slot->data);
    slot->busy = false;
  }
  if (s != DDP_OK) {
    ddp_error_wrap(s, "backward of micro-batch %d", mb);
    return fail(pp, s, g, g);
  }
  t->busy = false;
  return DDP_OK;
}

static ddp_status act(ddp_pipeline *pp, run_args *a, const ddp_pipeline_action *x) {
  int g = x->stage, mb = x->microbatch;
  pp_chunk *c = &pp->chunks[chunk_of(pp, g)];
  size_t in_bytes = (size_t)(pp->rows[mb] * c->in_row) * sizeof(float);
  size_t out_bytes = (size_t)(pp->rows[mb] * c->out_row) * sizeof(float);
  int i;
  switch (x->kind) {
  case DDP_PIPELINE_RECV_ACT:
    /* An activation slot's last transfer was the send of its gradient. */
    DDP_TRY(take_slot(pp, c->acts, c->n_acts, g, g - 1, &i));
    c->act_of[mb] = i;
    return post(pp, false, DDP__PP_ACT, x->peer, c->acts[i].data, in_bytes, &c->acts[i].work, g,
                mb, g - 1, "receive of activations");
  case DDP_PIPELINE_RECV_GRAD:
    DDP_TRY(take_slot(pp, c->grads, c->n_grads, g, g + 1, &i));
    c->grad_of[mb] = i;
    return post(pp, false, DDP__PP_GRAD, x->peer, c->grads[i].data, out_bytes, &c->grads[i].work,
                g, mb, g + 1, "receive of gradients");
  case DDP_PIPELINE_FORWARD:
    return forward(pp, a, x);
  case DDP_PIPELINE_BACKWARD:
    return backward(pp, x);
  case DDP_PIPELINE_SEND_ACT: {
    pp_tape *t = &c->tapes[c->tape_of[mb]];
    DDP_TRY(post(pp, true, DDP__PP_ACT, x->peer, c->outputs[mb]->data, out_bytes, &t->send, g, mb,
                 g + 1, "send of activations"));
    if (!a->training) t->busy = false; /* reset once the send is done */
    return DDP_OK;
  }
  case DDP_PIPELINE_SEND_GRAD: {
    pp_slot *slot = &c->acts[c->act_of[mb]];
    DDP_TRY(post(pp, true, DDP__PP_GRAD, x->peer, slot->grad, in_bytes, &slot->work, g, mb, g - 1,
                 "send of gradients"));
    slot->busy = false; /* taken again once the send is done */
    return DDP_OK;
  }
  default:
    return ddp_error(DDP_ERR_INTERNAL, "pipeline: unknown action %d", (int)x->kind);
  }
}

/* ---- A step ------------------------------------------------------------------------ */

static bool row_shape_is(const ddp_tensor *t, int ndim, const int64_t *shape) {
  if (t->ndim != ndim + 1) return false;
  for (int d = 0; d < ndim; d++)
    if (t->shape[d + 1] != shape[d]) return false;
  return true;
}

/* Every rank learns the batch's rows from stage 0: a small header goes down
 * the activation channels, rank 0 -> 1 -> ... -> p - 1, ahead of the step's
 * first activation (each channel is in order), so the step needs no
 * collective and a bad batch stops every rank before any activation moves.
 * The header is {rows, status}; status is not DDP_OK when rank 0 refused its
 * input, and every rank then returns that refusal (the pipeline stays
 * usable). */
static ddp_status refuse_input(const ddp_pipeline *pp, const run_args *a, char *why, size_t bytes) {
  const ddp_tensor *x = a->input;
  char have[DDP_SHAPE_STR_BYTES];
  if (!x)
    snprintf(why, bytes, "stage 0 (rank 0) got no input");
  else if (x->dtype != DDP_FLOAT32 || !row_shape_is(x, pp->stage_ndim[0], pp->stage_shape[0]))
    snprintf(why, bytes, "stage 0's input %s %s does not have the sample shape the pipeline was "
             "set up with", ddp_dtype_name(x->dtype), ddp_tensor_shape_str(x, have, sizeof have));
  else if (x->shape[0] < pp->m || (x->shape[0] + pp->m - 1) / pp->m > pp->max_rows)
    snprintf(why, bytes, "a batch of %lld rows does not make %d micro-batches of 1 to %lld rows "
             "(options.max_batch)", (long long)x->shape[0], pp->m, (long long)pp->max_rows);
  else
    return DDP_OK;
  return DDP_ERR_SHAPE;
}

static ddp_status agree_batch(ddp_pipeline *pp, const run_args *a, int64_t *rows) {
  int64_t *h = pp->header; /* {rows, status}, sent as 4 floats' bytes */
  char why[512] = "";
  int first = pp->chunks[0].stage;
  /* The last step's header may still be on its way out of this buffer. */
  DDP_TRY(wait_xfer(pp, &pp->header_work, "an earlier send of the batch's size", first, -1,
                    first + 1));
  /* On a GPU the header travels in device memory (an nccl channel takes
   * nothing else), copied from and to h. */
  const bool on_device = pp->header_dev != NULL;
  void *wire = on_device ? pp->header_dev->data : (void *)h;
  if (pp->rank == 0) {
    ddp_status st = refuse_input(pp, a, why, sizeof why);
    h[0] = st == DDP_OK ? a->input->shape[0] : 0;
    h[1] = st;
    if (on_device && pp->p > 1) {
      ddp_status cs = ddp_device_copy(pp->device, wire, DDP_CPU, h, 16);
      if (cs != DDP_OK) {
        ddp_error_wrap(cs, "copying the batch's size to %s", "the device");
        return fail(pp, cs, first, first);
      }
    }
  } else {
    ddp_work *w = NULL;
    DDP_TRY(post(pp, false, DDP__PP_ACT, pp->rank - 1, wire, 16, &w, first, -1, first - 1,
                 "receive of the batch's size"));
    DDP_TRY(wait_xfer(pp, &w, "the receive of the batch's size", first, -1, first - 1));
    if (on_device) {
      ddp_status cs = ddp_device_copy(DDP_CPU, h, pp->device, wire, 16);
      if (cs != DDP_OK) {
        ddp_error_wrap(cs, "copying the batch's size from the device");
        return fail(pp, cs, first, first);
      }
    }
  }
  if (pp->rank + 1 < pp->p) {
    DDP_TRY(post(pp, true, DDP__PP_ACT, pp->rank + 1, wire, 16, &pp->header_work, first, -1,
                 first + 1, "send of the batch's size"));
  }
  if (h[1] != DDP_OK) {
    /* The refusal travels on: every rank returns it, nothing else ran. */
    if (pp->rank + 1 < pp->p)
      DDP_TRY(wait_xfer(pp, &pp->header_work, "the send of the batch's size", first, -1,
                        first + 1));
    if (pp->rank == 0) return ddp_error((ddp_status)h[1], "pipeline: %s", why);
    return ddp_error((ddp_status)h[1], "pipeline: stage 0 (rank 0) refused its input (its error "
                     "says why)");
  }
  *rows = h[0];
  if (ddp_pipeline_is_last(pp) && a->target &&
      (a->target->ndim < 1 || a->target->shape[0] != h[0])) {
    char have[DDP_SHAPE_STR_BYTES];
    ddp_error(DDP_ERR_SHAPE, "the target %s does not have the input's %lld rows",
              ddp_tensor_shape_str(a->target, have, sizeof have), (long long)h[0]);
    return fail(pp, DDP_ERR_SHAPE, pp->n_stages - 1, pp->n_stages - 1);
  }
  if (ddp_pipeline_is_last(pp) && a->output) {
    int64_t want = h[0] * pp->chunks[pp->v - 1].out_row;
    if (a->output->dtype != DDP_FLOAT32 || a->output->numel != want) {
      char have[DDP_SHAPE_STR_BYTES];
      ddp_error(DDP_ERR_SHAPE, "the output tensor %s %s does not hold the batch's %lld rows of "
                "%lld floats", ddp_dtype_name(a->output->dtype),
                ddp_tensor_shape_str(a->output, have, sizeof have), (long long)h[0],
                (long long)pp->chunks[pp->v - 1].out_row);
      return fail(pp, DDP_ERR_SHAPE, pp->n_stages - 1, pp->n_stages - 1);
    }
  }
  if (ddp_pipeline_is_last(pp) && a->training && !a->target) {
    ddp_error(DDP_ERR_INVALID, "the last stage (rank %d) got no target", pp->rank);
    return fail(pp, DDP_ERR_INVALID, pp->n_stages - 1, pp->n_stages - 1);
  }
  return DDP_OK;
}

static ddp_status run(ddp_pipeline *pp, const ddp_pipeline_schedule *sched, run_args *a) {
  if (pp->failed)
    return ddp_error(DDP_ERR_STATE, "pipeline stage %d (rank %d): unusable after an earlier "
                     "failure: %s", pp->rank, pp->rank, pp->failure);
  int64_t t0 = ddp_time_ns();
  pp->wait_ns = 0;
  int64_t n;
  DDP_TRY(agree_batch(pp, a, &n));
  /* torch.tensor_split: the first n % M micro-batches get one row more. */
  for (int mb = 0, off = 0; mb < pp->m; mb++) {
    pp->rows[mb] = n / pp->m + (mb < n % pp->m);
    pp->offsets[mb] = off;
    off += (int)pp->rows[mb];
  }
  int count;
  const ddp_pipeline_action *list = ddp_pipeline_schedule_actions(sched, pp->rank, &count);
  for (int i = 0; i < count; i++) DDP_TRY(act(pp, a, &list[i]));
  if (a->losses_pending) {
    /* The losses copied back (forward): one wait for the device. */
    int last_stage = pp->n_stages - 1;
    ddp_status s = ddp_device_synchronize(pp->device);
    if (s != DDP_OK) {
      ddp_error_wrap(s, "reading the micro-batches' losses back");
      return fail(pp, s, last_stage, last_stage);
    }
    for (int mb = 0; mb < pp->m; mb++)
      a->loss_sum += a->training ? (double)pp->loss_host[mb]
                                 : (double)pp->loss_host[mb] * (double)pp->rows[mb];
  }
  if (a->training && pp->sync_fn) {
    ddp_status s = pp->sync_fn(pp->sync_user, pp->model);
    if (s != DDP_OK) return ddp_error_wrap(s, "pipeline stage %d (rank %d): gradient sync",
                                           pp->rank, pp->rank);
  }
  if (a->training) {
    double step = (double)(ddp_time_ns() - t0) * 1e-9, wait = (double)pp->wait_ns * 1e-9;
    pp->stats.steps++;
    pp->stats.step_s = step;
    pp->stats.wait_s = wait;
    pp->stats.idle_fraction = step > 0 ? wait / step : 0;
    pp->sum_step_s += step;
    pp->sum_wait_s += wait;
    pp->stats.idle_fraction_mean = pp->sum_step_s > 0 ? pp->sum_wait_s / pp->sum_step_s : 0;
  }
  return DDP_OK;
}

ddp_status ddp_pipeline_step(ddp_pipeline *pp, const ddp_tensor *input, const ddp_tensor *target,
                             double *loss) {
  run_args a = {true, input, target, NULL, 0, false, false};
  if (loss) *loss = NAN;
  DDP_TRY(run(pp, pp->train, &a));
  if (loss && a.have_loss) *loss = a.loss_sum / pp->m;
  return DDP_OK;
}

ddp_status ddp_pipeline_eval(ddp_pipeline *pp, const ddp_tensor *input, const ddp_tensor *target,
                             ddp_tensor *output, double *loss) {
  if (loss) *loss = NAN;
  bool last = ddp_pipeline_is_last(pp);
  run_args a = {false, input, last ? target : NULL, last ? output : NULL, 0, false, false};
  bool training = ddp_model_is_training(pp->model);
  ddp_model_train(pp->model, false);
  ddp_status s = run(pp, pp->eval, &a);
  ddp_model_train(pp->model, training);
  DDP_TRY(s);
  if (loss && a.have_loss && input) *loss = a.loss_sum / (double)input->shape[0];
  if (loss && a.have_loss && !input) {
    int64_t n = 0;
    for (int mb = 0; mb < pp->m; mb++) n += pp->rows[mb];
    *loss = a.loss_sum / (double)n;
  }
  return DDP_OK;
}

void ddp__pp_chunks_free(ddp_pipeline *pp) {
  ddp_work_free(pp->header_work);
  pp->header_work = NULL;
  for (int ci = 0; ci < pp->v; ci++) {
    pp_chunk *c = &pp->chunks[ci];
    if (c->acts)
      for (int i = 0; i < c->n_acts; i++) {
        ddp_work_free(c->acts[i].work);
        ddp_tensor_destroy(c->acts[i].data_mem);
        ddp_tensor_destroy(c->acts[i].grad_mem);
      }
    if (c->grads)
      for (int i = 0; i < c->n_grads; i++) {
        ddp_work_free(c->grads[i].work);
        ddp_tensor_destroy(c->grads[i].data_mem);
      }
    if (c->tapes)
      for (int i = 0; i < c->n_tapes; i++) {
        ddp_work_free(c->tapes[i].send);
        ddp_tape_destroy(c->tapes[i].tape);
      }
    ddp_free(c->acts);
    ddp_free(c->grads);
    ddp_free(c->tapes);
    ddp_free(c->act_of);
    ddp_free(c->grad_of);
    ddp_free(c->tape_of);
    ddp_free(c->inputs);
    ddp_free(c->targets);
    ddp_free(c->outputs);
    ddp_free(c->losses);
    ddp_free(c->mods);
  }
}
