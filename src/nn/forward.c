/* The forward pass of a model: each module maps to one tensor op, containers
 * run their children in order. Errors are wrapped with the module's path
 * ("layer2.0 (Conv2d): conv2d: input (8,3,14,14) has 3 channels, ..."), so a
 * shape mistake names the layer. Also the model's loss. */
#include "nn/module.h"
#include "tensor/tape.h"

static ddp_status run_leaf(ddp_model *model, ddp_module *m, ddp_tape *tape, ddp_tensor *x,
                           ddp_tensor **out) {
  switch (m->kind) {
  case DDP_MODULE_LINEAR:
    return ddp_linear(tape, x, m->weight, m->bias, out);
  case DDP_MODULE_CONV2D:
    return ddp_conv2d(tape, x, m->weight, m->bias, m->stride, m->padding, out);
  case DDP_MODULE_BATCHNORM2D:
    return ddp_sync_batch_norm(tape, x, m->weight, m->bias, m->running_mean, m->running_var,
                               m->num_batches_tracked, model->training, m->momentum, m->eps,
                               model->bn_synced ? &model->bn_sync : NULL, out);
  case DDP_MODULE_RELU:
    return ddp_relu(tape, x, out);
  case DDP_MODULE_SIGMOID:
    return ddp_sigmoid(tape, x, out);
  case DDP_MODULE_TANH:
    return ddp_tanh(tape, x, out);
  case DDP_MODULE_MAXPOOL2D:
    return ddp_max_pool2d(tape, x, m->kernel, m->stride, out);
  case DDP_MODULE_DROPOUT:
    return ddp_dropout(tape, x, m->p, model->training, &model->dropout_rng, out);
  case DDP_MODULE_DROPOUT2D:
    return ddp_dropout2d(tape, x, m->p, model->training, &model->dropout_rng, out);
  case DDP_MODULE_FLATTEN:
    return ddp_flatten(tape, x, m->start_dim, out);
  case DDP_MODULE_LOGSOFTMAX:
    return ddp_log_softmax(tape, x, out);
  default:
    return ddp_error(DDP_ERR_INTERNAL, "nn: module kind %d has no forward", (int)m->kind);
  }
}

/* The leaf module that produces m's output: m itself, or for a Sequential
 * its last child's (NULL for an empty one, whose output is its input). */
static const ddp_module *last_leaf(const ddp_module *m) {
  while (m && m->kind == DDP_MODULE_SEQUENTIAL) m = m->last_child;
  return m;
}

/* The leaf module that first reads m's input (NULL for an empty Sequential). */
static const ddp_module *first_leaf(const ddp_module *m) {
  while (m && m->kind == DDP_MODULE_SEQUENTIAL) m = m->first_child;
  return m;
}

static bool is_kind(const ddp_module *m, ddp_module_kind kind) { return m && m->kind == kind; }

ddp_status ddp__module_forward(ddp_model *model, ddp_module *m, ddp_tape *tape, ddp_tensor *x,
                               ddp_tensor **out) {
  if (m->kind != DDP_MODULE_SEQUENTIAL) {
    ddp_status s = run_leaf(model, m, tape, x, out);
    if (s != DDP_OK)
      return ddp_error_wrap(s, "%s (%s)", m->path, ddp__module_kind_name(m->kind));
    return DDP_OK;
  }
  /* An empty Sequential is the identity, as in PyTorch. */
  ddp_tensor *h = x;
  const ddp_module *made_h = NULL; /* the child whose output h is, if any */
  const ddp_module *made_made_h = NULL; /* the child before it, if any */
  const bool hooked = m == model->root && model->forward_hook;
  for (ddp_module *c = m->first_child; c; made_made_h = made_h, made_h = c, c = c->next_sibling) {
    ddp_module *next = c->next_sibling;
    ddp_module *const first = c; /* the child this iteration starts at (it may fuse the next) */
    if (hooked) {
      ddp_status s = model->forward_hook(model, first->name, false, model->forward_hook_user);
      if (s != DDP_OK) return ddp_error_wrap(s, "the forward hook before %s", first->path);
    }
    ddp_module *third = next ? next->next_sibling : NULL;
    if (c->kind == DDP_MODULE_BATCHNORM2D && next && next->kind == DDP_MODULE_RELU && third &&
        third->kind == DDP_MODULE_MAXPOOL2D && h->ndim == 4) {
      /* BatchNorm2d, ReLU, MaxPool2d: one op that stores neither the
       * normalised nor the rectified values (ddp_batch_norm_relu_max_pool2d).
       * A convolution's output that only this block reads, and that this
       * runner hands to no one else, may become its own gradient in
       * backward: conv2d's backward never reads it. */
      if (is_kind(last_leaf(made_h), DDP_MODULE_CONV2D) && h != x) h->flags |= DDP__TENSOR_REUSABLE;
      ddp_status s = ddp_batch_norm_relu_max_pool2d(
          tape, h, c->weight, c->bias, c->running_mean, c->running_var, c->num_batches_tracked,
          model->training, c->momentum, c->eps, model->bn_synced ? &model->bn_sync : NULL,
          third->kernel, third->stride, &h);
      if (s != DDP_OK)
        return ddp_error_wrap(s, "%s, %s and %s (BatchNorm2d, ReLU, MaxPool2d)", c->path,
                              next->path, third->path);
      c = third;
      goto after;
    }
    if (c->kind == DDP_MODULE_RELU && next && next->kind == DDP_MODULE_MAXPOOL2D) {
      /* ReLU then MaxPool2d: one op that never writes relu's output (the
       * same values and gradients; ddp_relu_max_pool2d). */
      ddp_status s = ddp_relu_max_pool2d(tape, h, next->kernel, next->stride, &h);
      if (s != DDP_OK)
        return ddp_error_wrap(s, "%s and %s (ReLU, MaxPool2d)", c->path, next->path);
      c = next;
      goto after;
    }
    /* A pooling's output that only this convolution reads, and that this
     * runner hands to no one else: max pooling's backward never reads its
     * output (nor do its fused forms'; relu-closed windows are marked in
     * the argmax), so conv2d's dx may overwrite it. Either may sit at the
     * edge of a nested Sequential (the ConvNet's layer1 ends with the
     * pooling and layer2 starts with the convolution): a Sequential hands
     * its input to its first child only. */
    if (is_kind(first_leaf(c), DDP_MODULE_CONV2D) && is_kind(last_leaf(made_h), DDP_MODULE_MAXPOOL2D) &&
        h != x)
      h->flags |= DDP__TENSOR_REUSABLE;
    /* Likewise a pooling's output flattened for a linear layer (the
     * ConvNet's fc): linear's backward reads the flattened values (for its
     * weight's gradient) before it writes their gradient, the flatten
     * hands that gradient to the pooling's output as it is (a view), and
     * the pooling's backward never reads its output. */
    if (is_kind(first_leaf(c), DDP_MODULE_LINEAR) &&
        is_kind(last_leaf(made_h), DDP_MODULE_FLATTEN) &&
        is_kind(last_leaf(made_made_h), DDP_MODULE_MAXPOOL2D) && h != x)
      h->flags |= DDP__TENSOR_REUSABLE;
    DDP_TRY(ddp__module_forward(model, c, tape, h, &h));
  after:
    if (hooked) {
      ddp_status s = model->forward_hook(model, first->name, true, model->forward_hook_user);
      if (s != DDP_OK) return ddp_error_wrap(s, "the forward hook after %s", first->path);
    }
  }
  *out = h;
  return DDP_OK;
}

ddp_status ddp_model_forward(ddp_model *model, ddp_tape *tape, ddp_tensor *x, ddp_tensor **out) {
  if (!model || !tape || !x || !out)
    return ddp_error(DDP_ERR_INVALID, "nn: forward: model, tape, input and out must not be NULL");
  if (!model->finalized)
    return ddp_error(DDP_ERR_STATE, "nn: forward: the model is not finalized "
                                    "(call ddp_model_finalize after adding modules)");
  ddp_status s = DDP_OK;
  if (model->forward_order) {
    ddp_tensor *h = x;
    for (int i = 0; i < model->n_forward && s == DDP_OK; i++) {
      ddp_module *c = model->forward_order[i];
      if (model->forward_hook) s = model->forward_hook(model, c->name, false, model->forward_hook_user);
      if (s == DDP_OK) s = ddp__module_forward(model, c, tape, h, &h);
      if (s == DDP_OK && model->forward_hook)
        s = model->forward_hook(model, c->name, true, model->forward_hook_user);
    }
    *out = h;
  } else {
    s = ddp__module_forward(model, model->root, tape, x, out);
  }
  if (s != DDP_OK) return ddp_error_wrap(s, "%s forward", model->name);
  return DDP_OK;
}

ddp_status ddp_model_loss(ddp_model *model, ddp_tape *tape, ddp_tensor *output,
                          ddp_tensor *target, ddp_tensor **loss) {
  ddp_status s;
  switch (model->loss) {
  case DDP_LOSS_MSE:
    s = ddp_mse_loss(tape, output, target, loss);
    break;
  case DDP_LOSS_CROSS_ENTROPY:
    s = ddp_cross_entropy(tape, output, target, loss);
    break;
  case DDP_LOSS_NLL:
    s = ddp_nll_loss(tape, output, target, loss);
    break;
  default:
    return ddp_error(DDP_ERR_STATE, "nn: loss: the model (%s) has no loss kind; call "
                                    "ddp_model_set_loss", model->name);
  }
  if (s != DDP_OK) return ddp_error_wrap(s, "%s loss (%s)", model->name, ddp_loss_name(model->loss));
  return DDP_OK;
}

void ddp_model_set_loss(ddp_model *model, ddp_loss_kind kind) { model->loss = kind; }
ddp_loss_kind ddp_model_loss_kind(const ddp_model *model) { return model->loss; }

const char *ddp_loss_name(ddp_loss_kind kind) {
  switch (kind) {
  case DDP_LOSS_MSE: return "mse";
  case DDP_LOSS_CROSS_ENTROPY: return "cross_entropy";
  case DDP_LOSS_NLL: return "nll";
  default: return "none";
  }
}
