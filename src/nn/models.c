/* The seeds' models as ready builders, with the module names their PyTorch
 * definitions use, so that state dicts match name for name (docs/nn.md). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nn/module.h"

#define CONVNET_N_MIN 2
#define CONVNET_N_MAX 10

const char *ddp_model_names(void) {
  return "toy, headtail, convnet, psnet, convnet-N (N in 2..10), mlp:WxD (W in 1..65536, D in 2..64)";
}

/* seed 001's ToyModel: net2(relu(net1(x))), x (N, 10) -> (N, 5). */
static ddp_status build_toy(ddp_model *m) {
  DDP_TRY(ddp_module_add_linear(m, NULL, "net1", 10, 10, true, NULL));
  DDP_TRY(ddp_module_add_relu(m, NULL, "relu", NULL));
  DDP_TRY(ddp_module_add_linear(m, NULL, "net2", 10, 5, true, NULL));
  ddp_model_set_loss(m, DDP_LOSS_MSE);
  ddp_model_set_sample_shape(m, 1, (int64_t[]){10});
  m->num_outputs = 5;
  return DDP_OK;
}

/* mlp:WxD, for measuring memory at any size on the regression data: D
 * linear layers fc0..fc{D-1}, 10 -> W -> ... -> W -> 5, a ReLU after each
 * but the last (W * W per hidden layer: mlp:4096x8 has 100.8 M
 * parameters). */
static ddp_status build_mlp(ddp_model *m, long width, long depth) {
  for (long i = 0; i < depth; i++) {
    char name[32];
    snprintf(name, sizeof name, "fc%ld", i);
    DDP_TRY(ddp_module_add_linear(m, NULL, name, i ? width : 10, i + 1 < depth ? width : 5, true,
                                  NULL));
    if (i + 1 < depth) {
      snprintf(name, sizeof name, "relu%ld", i);
      DDP_TRY(ddp_module_add_relu(m, NULL, name, NULL));
    }
  }
  ddp_model_set_loss(m, DDP_LOSS_MSE);
  ddp_model_set_sample_shape(m, 1, (int64_t[]){10});
  m->num_outputs = 5;
  return DDP_OK;
}

/* "mlp:WxD" into width and depth. */
static bool parse_mlp(const char *name, long *width, long *depth) {
  if (strncmp(name, "mlp:", 4) != 0) return false;
  char *end;
  *width = strtol(name + 4, &end, 10);
  if (end == name + 4 || *end != 'x') return false;
  const char *d = end + 1;
  *depth = strtol(d, &end, 10);
  return end != d && *end == '\0';
}

/* seed 000's ToyModel (split over two devices there): tail(head(x)), no
 * activation between, x (N, 32) -> (N, 10) logits. */
static ddp_status build_headtail(ddp_model *m) {
  DDP_TRY(ddp_module_add_linear(m, NULL, "head", 32, 32, true, NULL));
  DDP_TRY(ddp_module_add_linear(m, NULL, "tail", 32, 10, true, NULL));
  ddp_model_set_loss(m, DDP_LOSS_CROSS_ENTROPY);
  ddp_model_set_sample_shape(m, 1, (int64_t[]){32});
  m->num_outputs = 10;
  return DDP_OK;
}

static ddp_status conv_bn_block(ddp_model *m, const char *name, int64_t in, int64_t out) {
  ddp_module *seq;
  DDP_TRY(ddp_module_add_sequential(m, NULL, name, &seq));
  DDP_TRY(ddp_module_add_conv2d(m, seq, NULL, in, out, 5, 1, 2, true, NULL));
  DDP_TRY(ddp_module_add_batchnorm2d(m, seq, NULL, out, NULL));
  DDP_TRY(ddp_module_add_relu(m, seq, NULL, NULL));
  DDP_TRY(ddp_module_add_maxpool2d(m, seq, NULL, 2, 2, NULL));
  return DDP_OK;
}

/* seed 001's (and refs/torch_ddp_convnet.py's) ConvNet:
 * x (N,1,28,28) -> layer1 (N,16,14,14) -> layer2 (N,32,7,7) -> flatten (N,1568) -> fc (N,10). */
static ddp_status build_convnet(ddp_model *m) {
  DDP_TRY(conv_bn_block(m, "layer1", 1, 16));
  DDP_TRY(conv_bn_block(m, "layer2", 16, 32));
  DDP_TRY(ddp_module_add_flatten(m, NULL, "flatten", 1, NULL));
  DDP_TRY(ddp_module_add_linear(m, NULL, "fc", 7 * 7 * 32, 10, true, NULL));
  ddp_model_set_loss(m, DDP_LOSS_CROSS_ENTROPY);
  ddp_model_set_sample_shape(m, 3, (int64_t[]){1, 28, 28});
  m->num_outputs = 10;
  return DDP_OK;
}

/* The RPC parameter-server tutorial's Net (pytorch/examples' MNIST net):
 * conv1 (N,32,26,26), relu, conv2 (N,64,24,24), max_pool2d (N,64,12,12),
 * dropout1, flatten (N,9216), fc1 (N,128), relu, dropout2, fc2 (N,10),
 * log_softmax. The functional calls get names of their own; they hold no state. */
static ddp_status build_psnet(ddp_model *m) {
  DDP_TRY(ddp_module_add_conv2d(m, NULL, "conv1", 1, 32, 3, 1, 0, true, NULL));
  DDP_TRY(ddp_module_add_relu(m, NULL, "relu1", NULL));
  DDP_TRY(ddp_module_add_conv2d(m, NULL, "conv2", 32, 64, 3, 1, 0, true, NULL));
  DDP_TRY(ddp_module_add_maxpool2d(m, NULL, "max_pool2d", 2, 2, NULL));
  DDP_TRY(ddp_module_add_dropout2d(m, NULL, "dropout1", 0.25f, NULL));
  DDP_TRY(ddp_module_add_flatten(m, NULL, "flatten", 1, NULL));
  DDP_TRY(ddp_module_add_linear(m, NULL, "fc1", 9216, 128, true, NULL));
  DDP_TRY(ddp_module_add_relu(m, NULL, "relu2", NULL));
  DDP_TRY(ddp_module_add_dropout2d(m, NULL, "dropout2", 0.5f, NULL));
  DDP_TRY(ddp_module_add_linear(m, NULL, "fc2", 128, 10, true, NULL));
  DDP_TRY(ddp_module_add_log_softmax(m, NULL, "log_softmax", NULL));
  ddp_model_set_loss(m, DDP_LOSS_NLL);
  ddp_model_set_sample_shape(m, 3, (int64_t[]){1, 28, 28});
  m->num_outputs = 10;
  return DDP_OK;
}

typedef enum { ACT_RELU, ACT_SIGMOID, ACT_TANH } activation;

/* Propulate's tutorial Net: conv_layers = N blocks Sequential(Conv2d(c,10,3,
 * padding=1), act), c = 1 for the first and 10 after; x.view(b, 7840); fc
 * (N,10); log_softmax. Its __init__ assigns self.fc before self.conv_layers,
 * so PyTorch's state_dict (and parameters()) start with fc.weight, fc.bias;
 * we register in that order and set the forward order apart. */
static ddp_status build_convnet_n(ddp_model *m, int n, activation act) {
  ddp_module *fc, *layers, *view, *log_softmax;
  DDP_TRY(ddp_module_add_linear(m, NULL, "fc", 7840, 10, true, &fc));
  DDP_TRY(ddp_module_add_sequential(m, NULL, "conv_layers", &layers));
  for (int i = 0; i < n; i++) {
    ddp_module *block;
    DDP_TRY(ddp_module_add_sequential(m, layers, NULL, &block));
    DDP_TRY(ddp_module_add_conv2d(m, block, NULL, i == 0 ? 1 : 10, 10, 3, 1, 1, true, NULL));
    switch (act) {
    case ACT_RELU: DDP_TRY(ddp_module_add_relu(m, block, NULL, NULL)); break;
    case ACT_SIGMOID: DDP_TRY(ddp_module_add_sigmoid(m, block, NULL, NULL)); break;
    case ACT_TANH: DDP_TRY(ddp_module_add_tanh(m, block, NULL, NULL)); break;
    }
  }
  DDP_TRY(ddp_module_add_flatten(m, NULL, "view", 1, &view));
  DDP_TRY(ddp_module_add_log_softmax(m, NULL, "log_softmax", &log_softmax));
  ddp_module *order[4] = {layers, view, fc, log_softmax};
  DDP_TRY(ddp_model_set_forward_order(m, 4, order));
  ddp_model_set_loss(m, DDP_LOSS_NLL);
  ddp_model_set_sample_shape(m, 3, (int64_t[]){1, 28, 28});
  m->num_outputs = 10;
  return DDP_OK;
}

/* Parses "convnet-N": true with *n set when name has that form (any N). */
static bool parse_convnet_n(const char *name, long *n) {
  static const char prefix[] = "convnet-";
  if (strncmp(name, prefix, sizeof prefix - 1) != 0) return false;
  const char *digits = name + sizeof prefix - 1;
  /* Canonical decimal only: "convnet-03" is not a name PyTorch users type. */
  if (*digits < '1' || *digits > '9') return false;
  char *end;
  *n = strtol(digits, &end, 10);
  return *end == '\0';
}

ddp_status ddp_model_build(const char *name, const char *act_name, uint64_t seed,
                           ddp_model **out) {
  *out = NULL;
  if (!name)
    return ddp_error(DDP_ERR_INVALID, "nn: no model name given (choose one of: %s)",
                     ddp_model_names());
  bool has_act = act_name && act_name[0];
  long n = 0;
  bool is_convnet_n = parse_convnet_n(name, &n);
  long width = 0, depth = 0;
  bool is_mlp = parse_mlp(name, &width, &depth);
  if (is_mlp && (width < 1 || width > 65536 || depth < 2 || depth > 64))
    return ddp_error(DDP_ERR_INVALID, "nn: model '%s': mlp:WxD takes W in 1..65536 and D in 2..64",
                     name);
  bool known = is_convnet_n || is_mlp || !strcmp(name, "toy") || !strcmp(name, "headtail") ||
               !strcmp(name, "convnet") || !strcmp(name, "psnet");
  if (!known)
    return ddp_error(DDP_ERR_INVALID, "nn: unknown model '%s' (choose one of: %s)", name,
                     ddp_model_names());
  activation act = ACT_RELU;
  if (is_convnet_n) {
    if (n < CONVNET_N_MIN || n > CONVNET_N_MAX)
      return ddp_error(DDP_ERR_INVALID,
                       "nn: model '%s': N = %ld conv layers is out of range (convnet-N takes N in "
                       "%d..%d)", name, n, CONVNET_N_MIN, CONVNET_N_MAX);
    if (has_act) {
      if (!strcmp(act_name, "relu"))
        act = ACT_RELU;
      else if (!strcmp(act_name, "sigmoid"))
        act = ACT_SIGMOID;
      else if (!strcmp(act_name, "tanh"))
        act = ACT_TANH;
      else
        return ddp_error(DDP_ERR_INVALID,
                         "nn: model '%s': unknown activation '%s' (choose one of: relu, sigmoid, "
                         "tanh)", name, act_name);
    }
  } else if (has_act) {
    return ddp_error(DDP_ERR_INVALID,
                     "nn: model '%s' has a fixed architecture; the activation '%s' applies only to "
                     "convnet-N (N in %d..%d)", name, act_name, CONVNET_N_MIN, CONVNET_N_MAX);
  }

  ddp_model *m;
  DDP_TRY(ddp_model_create(&m));
  ddp_status s;
  if (is_convnet_n)
    s = build_convnet_n(m, (int)n, act);
  else if (is_mlp)
    s = build_mlp(m, width, depth);
  else if (!strcmp(name, "toy"))
    s = build_toy(m);
  else if (!strcmp(name, "headtail"))
    s = build_headtail(m);
  else if (!strcmp(name, "convnet"))
    s = build_convnet(m);
  else
    s = build_psnet(m);
  if (s == DDP_OK) s = ddp_model_finalize(m, seed);
  if (s != DDP_OK) {
    ddp_model_destroy(m);
    return ddp_error_wrap(s, "nn: building '%s'", name);
  }
  snprintf(m->name, sizeof m->name, "%s", name);
  *out = m;
  return DDP_OK;
}
