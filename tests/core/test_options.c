/* Every public options struct's ddp_<thing>_defaults() against the defaults
 * its header documents (the numbers are copied from the headers' comments,
 * not from the implementations), and zero-initialised structs still
 * accepted where zero means the defaults. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <cmocka.h>

#include "ddp/ddp.h"

static void test_comm_and_store_defaults_are_zero(void **state) {
  (void)state;
  ddp_process_group_options pg = ddp_process_group_defaults();
  assert_true(pg.timeout_s == 0.0);
  assert_null(pg.transport);

  ddp_store_options so = ddp_store_defaults();
  assert_int_equal(so.timeout_ms, 0);
  assert_int_equal(so.connect_timeout_ms, 0);
  assert_null(so.token);

  ddp_store_server_options ss = ddp_store_server_defaults();
  assert_null(ss.token);
  assert_int_equal(ss.limits.max_key_bytes, 0);
  assert_int_equal(ss.limits.max_keys_per_call, 0);
  assert_int_equal(ss.limits.max_value_bytes, 0);
  assert_int_equal(ss.limits.max_message_bytes, 0);
  assert_int_equal(ss.limits.max_clients, 0);
  assert_int_equal(ss.limits.max_total_bytes, 0);
  assert_int_equal(ss.handshake_timeout_ms, 0);
}

/* Zero means the defaults for these: a {0} struct and NULL are accepted,
 * and the store's timeout is the documented default. */
static void test_zero_initialised_still_works(void **state) {
  (void)state;
  ddp_store_options zero_store = {0};
  ddp_store *store = NULL;
  assert_int_equal(ddp_store_mem_create(&zero_store, &store), DDP_OK);
  assert_int_equal(ddp_store_timeout_ms(store), ddp_store_default_timeout_ms());

  ddp_process_group_options zero_pg = {0};
  ddp_process_group *pg = NULL;
  assert_int_equal(ddp_process_group_create(store, 0, 1, &zero_pg, &pg), DDP_OK);
  assert_int_equal(ddp_process_group_size(pg), 1);
  float x[3] = {1, 2, 3};
  assert_int_equal(ddp_allreduce(pg, x, 3, DDP_FLOAT32, DDP_REDUCE_SUM), DDP_OK);
  assert_true(x[0] == 1 && x[1] == 2 && x[2] == 3);
  ddp_process_group_destroy(pg);
  ddp_store_destroy(store);

  ddp_store_server_options zero_server = {0};
  ddp_store_server *server = NULL;
  assert_int_equal(ddp_store_server_create("127.0.0.1", 0, &zero_server, &server), DDP_OK);
  assert_true(ddp_store_server_port(server) > 0);
  ddp_store_server_stop(server);
}

static void test_rendezvous_and_rpc_defaults(void **state) {
  (void)state;
  ddp_rendezvous_options r = ddp_rendezvous_defaults();
  assert_int_equal(r.rank, -1);
  assert_int_equal(r.world_size, -1);
  assert_true(r.timeout_s == 0.0);

  ddp_rpc_options o = ddp_rpc_defaults();
  assert_null(o.name);
  assert_null(o.init_method);
  assert_int_equal(o.rank, -1);
  assert_int_equal(o.world_size, -1);
  assert_int_equal(o.num_threads, 0);
  assert_int_equal(o.transport, DDP_RPC_TRANSPORT_AUTO);
  assert_true(o.timeout_s == 0.0);
  assert_true(o.init_timeout_s == 0.0);
  assert_null(o.store);
}

static void test_launch_defaults(void **state) {
  (void)state;
  /* "one worker on one node, static rendezvous, no restarts, monitor every
   * 0.1 s, 10 s grace, 900 s node rendezvous timeout, run id "none"" */
  ddp_launch_config c = ddp_launch_defaults();
  assert_int_equal(c.nproc_per_node, 1);
  assert_int_equal(c.nnodes, 1);
  assert_int_equal(c.node_rank, -1);
  assert_int_equal(c.rdzv_backend, DDP_LAUNCH_RDZV_STATIC);
  assert_int_equal(c.max_restarts, 0);
  assert_true(c.monitor_interval_s == 0.1);
  assert_true(c.grace_s == 10.0);
  assert_true(c.rdzv_timeout_s == 900.0);
  assert_string_equal(c.rdzv_id, "none");
  assert_string_equal(c.master_addr, "");
  assert_int_equal(c.master_port, 0);
  assert_null(c.program);
  assert_null(c.trace_dir);
  assert_null(c.may_fail);

  ddp_spawn_options s = ddp_spawn_defaults();
  assert_true(s.timeout_s == 0.0);
  assert_true(s.grace_s == 10.0);
  assert_int_equal(s.max_restarts, 0);
  assert_int_equal(s.tail_lines, 10);
  assert_int_equal(s.quiet, 0);
  assert_int_equal(s.bind, DDP_LAUNCH_BIND_AUTO);
  assert_int_equal(s.report_bindings, 0);
  assert_int_equal(s.threads_per_worker, 0);
}

static void test_data_defaults(void **state) {
  (void)state;
  ddp_loader_config l = ddp_loader_defaults();
  assert_int_equal(l.batch_size, 1);
  assert_false(l.shuffle);
  assert_false(l.drop_last);
  assert_int_equal(l.num_workers, 0);
  assert_int_equal(l.seed, 0);
  assert_false(l.normalize);
  assert_null(l.sampler);
  assert_true(l.timeout_s == 60.0);

  ddp_distributed_sampler_options d = ddp_distributed_sampler_defaults(4, 3);
  assert_int_equal(d.num_replicas, 4);
  assert_int_equal(d.rank, 3);
  assert_true(d.shuffle);
  assert_int_equal(d.seed, 0);
  assert_false(d.drop_last);
}

static void test_optim_defaults(void **state) {
  (void)state;
  ddp_optim_options sgd = ddp_optim_defaults(DDP_OPTIM_SGD);
  assert_int_equal(sgd.kind, DDP_OPTIM_SGD);
  assert_true(sgd.lr == 1e-3);
  assert_true(sgd.sgd.momentum == 0.0 && sgd.sgd.dampening == 0.0 && !sgd.sgd.nesterov);
  assert_true(sgd.weight_decay == 0.0 && !sgd.maximize);
  assert_int_equal(sgd.device.type, DDP_CPU.type);
  ddp_optim_options adam = ddp_optim_defaults(DDP_OPTIM_ADAM);
  assert_true(adam.lr == 1e-3 && adam.adam.beta1 == 0.9 && adam.adam.beta2 == 0.999 &&
              adam.adam.eps == 1e-8 && !adam.adam.amsgrad);
  ddp_optim_options ada = ddp_optim_defaults(DDP_OPTIM_ADADELTA);
  assert_true(ada.lr == 1.0 && ada.adadelta.rho == 0.9 && ada.adadelta.eps == 1e-6);

  ddp_step_lr_options st = ddp_step_lr_defaults(30);
  assert_int_equal(st.step_size, 30);
  assert_true(st.gamma == 0.1);
  assert_int_equal(st.last_epoch, -1);
  assert_true(isnan(st.base_lr));
}

static void test_parallel_and_pipeline_defaults(void **state) {
  (void)state;
  ddp_dp_options dp = ddp_dp_defaults();
  assert_true(dp.bucket_cap_mb == 25.0 && dp.first_bucket_mb == 1.0);
  assert_true(dp.broadcast_buffers && !dp.find_unused_parameters && dp.relayout && !dp.static_graph);

  ddp_pipeline_options p = ddp_pipeline_defaults();
  assert_int_equal(p.schedule, DDP_PIPELINE_1F1B);
  assert_int_equal(p.n_microbatches, 4);
  assert_int_equal(p.virtual_stages, 1);
  assert_null(p.split);
  assert_true(p.grad_scale == 0.0);
  assert_int_equal(p.sample_ndim, 0);
  assert_int_equal(p.profile_rows, 32);
  assert_int_equal(p.max_batch, 256);
  assert_true(p.timeout_s == 0.0);
}

static void test_train_defaults(void **state) {
  (void)state;
  ddp_train_options o = ddp_train_defaults();
  assert_int_equal(o.epochs, 1);
  assert_int_equal(o.max_steps, 0);
  assert_int_equal(o.batch_size, 100);
  assert_int_equal(o.optim.kind, DDP_OPTIM_SGD);
  assert_true(o.optim.lr == 0.01 && o.optim.sgd.momentum == 0.0);
  assert_int_equal(o.step_lr_size, 0);
  assert_true(o.step_lr_gamma == 0.1);
  assert_int_equal(o.seed, 1);
  assert_int_equal(o.workers, -1);
  assert_int_equal(o.eval_every, 0);
  assert_int_equal(o.patience, 0);
  assert_null(o.log_path);
  assert_null(o.save_path);
  assert_null(o.resume_path);
  assert_false(o.cuda_graph);
  assert_true(o.bucket_cap_mb == 0.0);
  assert_null(o.trace_path);
  assert_int_equal(o.microbatches, 0);
  assert_null(o.pipeline);
  assert_null(o.param_server);

  ddp_train_pipeline tp = ddp_train_pipeline_defaults();
  assert_int_equal(tp.stages, 2);
  assert_int_equal(tp.schedule, DDP_PIPELINE_1F1B);
  assert_int_equal(tp.virtual_stages, 1);
  assert_null(tp.split);
}

static void test_hpo_defaults(void **state) {
  (void)state;
  /* Propulate's get_default_propagator: pop_size 4, crossover 0.7, point
   * mutation 0.4, random re-initialisation 0.1, sigma factor 0.05. */
  ddp_hpo_options o = ddp_hpo_defaults();
  assert_int_equal(o.pop_size, 4);
  assert_true(o.crossover_prob == 0.7 && o.mutation_prob == 0.4);
  assert_true(o.random_init_prob == 0.1 && o.sigma_factor == 0.05);
  assert_int_equal(o.ranks_per_worker, 1);
  assert_true(o.exchange_interval_s == 0.001);
  assert_int_equal(o.islands, 1);
  assert_true(o.migration_prob == 0.9);
  assert_int_equal(o.num_migrants, 1);
  assert_true(o.pollination);
  assert_null(o.checkpoint_dir);
  assert_true(o.checkpoint_interval_s == 1.0);
  assert_false(o.resume);
  assert_null(o.fingerprint);
}

static void test_ps_defaults(void **state) {
  (void)state;
  ddp_ps_options o = ddp_ps_defaults();
  assert_int_equal(o.num_servers, 1);
  assert_int_equal(o.num_trainers, 1);
  assert_int_equal(o.mode, DDP_PS_SYNC);
  assert_int_equal(o.staleness, 0);
  assert_true(o.timeout_s == 0.0);
  assert_int_equal(ddp_ps_options_check(&o), DDP_OK);
  /* Zero is not the defaults here: a job without servers is refused. */
  ddp_ps_options zero = {0};
  assert_int_equal(ddp_ps_options_check(&zero), DDP_ERR_INVALID);

  ddp_ps_server_options s = ddp_ps_server_defaults();
  assert_int_equal(s.ps.num_servers, 1);
  assert_int_equal(s.ps.num_trainers, 1);
  assert_int_equal(s.index, 0);
  assert_int_equal(s.optim.kind, DDP_OPTIM_SGD);
  assert_true(s.optim.lr == 1e-3);
  assert_int_equal(s.step_lr_size, 0);
  assert_true(s.step_lr_gamma == 0.1);
  assert_null(s.save_path);
  assert_null(s.resume_path);
  assert_null(s.checkpoint_meta);
  assert_int_equal(s.checkpoint_meta_count, 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_comm_and_store_defaults_are_zero),
      cmocka_unit_test(test_zero_initialised_still_works),
      cmocka_unit_test(test_rendezvous_and_rpc_defaults),
      cmocka_unit_test(test_launch_defaults),
      cmocka_unit_test(test_data_defaults),
      cmocka_unit_test(test_optim_defaults),
      cmocka_unit_test(test_parallel_and_pipeline_defaults),
      cmocka_unit_test(test_train_defaults),
      cmocka_unit_test(test_hpo_defaults),
      cmocka_unit_test(test_ps_defaults),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
