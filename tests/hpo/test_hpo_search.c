/* One worker's search reproduces Propulate 1.2.2 exactly: with the
 * Python-compatible generator seeded as Propulate's tutorials seed it, the
 * same space, options and objective give the same individuals in the same
 * order with the same losses, bit for bit, over 300 generations, on the
 * sphere (two floats) and on a mixed space (a categorical, an int, a float)
 * (tests/fixtures/hpo_propulate.txt, made by scripts/make_hpo_fixture.py
 * with Propulate from the reference environment), and with Propulate's
 * per-generation emigration draw on one island (migration probability 0.9,
 * tests/hpo/propulate_migration_draw.txt). And the space parser
 * refuses what it cannot search, naming the trait. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ddp/ddp.h"

/* The objectives, computed as the fixture's Python computes them. */
static double sphere(const ddp_hpo_space *s, const double *v, ddp_process_group *worker,
                     void *user) {
  (void)s, (void)user, (void)worker;
  return 0.0 + v[0] * v[0] + v[1] * v[1]; /* sum(v * v for v in values) */
}

static double mixed(const ddp_hpo_space *s, const double *v, ddp_process_group *worker,
                    void *user) {
  (void)s, (void)user, (void)worker;
  static const double cat_cost[3] = {0.0, 0.5, 0.25}; /* relu, sigmoid, tanh */
  double layers = (v[2] - 5) * (v[2] - 5);             /* an int's square: exact */
  return layers + pow(log10(v[1]) + 3, 2.0) + cat_cost[(int)v[0]];
}

typedef struct problem {
  const char *name, *space;
  ddp_hpo_objective fn;
} problem;

static const problem problems[] = {
    {"sphere", "a=float:-5.12:5.12,b=float:-5.12:5.12", sphere},
    {"mixed", "act=cat:relu|sigmoid|tanh,lr=float:1e-4:1e-2,layers=int:2:10", mixed},
};

/* Compares the search's individuals with the fixture's block for `p`,
 * searched with Propulate's migration_probability. */
static void check_problem(FILE *f, const problem *p, long seed, int pop, long gens,
                          double migration_prob) {
  ddp_hpo_space *space;
  if (ddp_hpo_space_parse(p->space, &space) != DDP_OK) fail_msg("%s", ddp_last_error());
  ddp_hpo_options o = ddp_hpo_defaults();
  o.generations = gens;
  o.pop_size = pop;
  o.seed = seed;
  o.migration_prob = migration_prob;
  ddp_hpo_result r;
  if (ddp_hpo_search(space, &o, p->fn, NULL, &r) != DDP_OK) fail_msg("%s", ddp_last_error());
  assert_int_equal(r.count, gens);
  char line[4096];
  for (long g = 0; g < gens; g++) {
    assert_non_null(fgets(line, sizeof line, f));
    char *at = line;
    long gen = strtol(at, &at, 10);
    double loss = strtod(at, &at);
    const ddp_hpo_individual *ind = &r.individuals[g];
    assert_int_equal(gen, g);
    char ours[512];
    ddp_hpo_format(space, ind->values, ours, sizeof ours);
    if (ind->loss != loss)
      fail_msg("%s generation %ld: loss %.17g, Propulate %.17g (ours: %s; theirs:%s)", p->name, g,
               ind->loss, loss, ours, at);
    for (int t = 0; t < ddp_hpo_space_size(space); t++) {
      const ddp_hpo_trait *tr = ddp_hpo_space_trait(space, t);
      char key[80];
      snprintf(key, sizeof key, " %s=", tr->name);
      char *v = strstr(at, key);
      assert_non_null(v);
      v += strlen(key);
      bool same;
      if (tr->kind == DDP_HPO_CATEGORICAL) {
        const char *name = tr->choices[(int)ind->values[t]];
        same = !strncmp(v, name, strlen(name)) && (v[strlen(name)] == ' ' || v[strlen(name)] == '\n');
      } else {
        same = strtod(v, NULL) == ind->values[t];
      }
      if (!same)
        fail_msg("%s generation %ld: %s differs (ours: %s; theirs:%s)", p->name, g, tr->name, ours,
                 at);
    }
  }
  ddp_hpo_result_free(&r);
  ddp_hpo_space_destroy(space);
}

/* The problems of the fixture at `rel` (hpo_propulate.txt's format), each
 * searched with migration_prob; returns how many. */
static int check_fixture(const char *rel, double migration_prob) {
  char path[4096], line[4096];
  const char *src = getenv("DDP_SOURCE_DIR");
  snprintf(path, sizeof path, "%s/%s", src ? src : ".", rel);
  FILE *f = fopen(path, "r");
  if (!f) fail_msg("cannot open %s", path);
  int done = 0;
  while (fgets(line, sizeof line, f)) {
    char name[64];
    long seed, gens;
    int pop;
    if (sscanf(line, "problem %63s %ld %d %ld", name, &seed, &pop, &gens) != 4) continue;
    const problem *p = NULL;
    for (size_t i = 0; i < sizeof problems / sizeof *problems; i++)
      if (!strcmp(problems[i].name, name)) p = &problems[i];
    if (!p) fail_msg("fixture problem '%s' unknown here", name);
    check_problem(f, p, seed, pop, gens, migration_prob);
    done++;
  }
  fclose(f);
  return done;
}

static void test_reproduces_propulate(void **state) {
  (void)state;
  /* scripts/make_hpo_fixture.py: migration_probability 0, no draws */
  assert_int_equal(check_fixture("tests/fixtures/hpo_propulate.txt", 0.0), 2);
}

/* With migration_probability 0.9 (the tutorials') on one island,
 * Propulate's worker draws its emigration decision every generation though
 * there is nowhere to send anyone; ddp draws it too. Without that draw the
 * sequence parts at generation 1. */
static void test_reproduces_propulate_migration_draw(void **state) {
  (void)state;
  assert_int_equal(check_fixture("tests/hpo/propulate_migration_draw.txt", 0.9), 1);
}

static void expect_refused(const char *spec, const char *message) {
  ddp_hpo_space *s = (ddp_hpo_space *)&s;
  assert_int_equal(ddp_hpo_space_parse(spec, &s), DDP_ERR_INVALID);
  assert_null(s);
  if (!strstr(ddp_last_error(), message))
    fail_msg("'%s': message '%s' lacks '%s'", spec, ddp_last_error(), message);
}

static void test_space_parser(void **state) {
  (void)state;
  ddp_hpo_space *s;
  /* Bounds in either order, Propulate's tutorial's lr among them. */
  assert_int_equal(ddp_hpo_space_parse("conv_layers=int:2:10,activation=cat:relu|sigmoid|tanh,"
                                       "lr=logfloat:0.01:0.0001,gamma=float:0.5:0.999",
                                       &s),
                   DDP_OK);
  assert_int_equal(ddp_hpo_space_size(s), 4);
  const ddp_hpo_trait *lr = ddp_hpo_space_trait(s, ddp_hpo_space_find(s, "lr"));
  assert_int_equal(lr->kind, DDP_HPO_LOGFLOAT);
  assert_true(lr->lo == 0.0001 && lr->hi == 0.01);
  const ddp_hpo_trait *act = ddp_hpo_space_trait(s, 1);
  assert_int_equal(act->n_choices, 3);
  assert_string_equal(act->choices[2], "tanh");
  double v[4] = {4, 2, 0.00123, 0.75};
  char buf[128];
  ddp_hpo_format(s, v, buf, sizeof buf);
  assert_string_equal(buf, "conv_layers=4 activation=tanh lr=0.00123 gamma=0.75");
  ddp_hpo_space_destroy(s);
  expect_refused("lr=logfloat:0:0.1", "lr: logfloat needs bounds > 0");
  expect_refused("n=int:2.5:4", "n: int bounds must be integers");
  expect_refused("x=float:1:1", "x: the bounds are equal");
  expect_refused("x=normal:0:1", "x: unknown kind 'normal'");
  expect_refused("a=cat:x||y", "a: an empty choice");
  expect_refused("a=cat:x|x", "a: 'x' twice");
  expect_refused("x=float:0:1,x=int:1:2", "trait 'x' twice");
  expect_refused("x=float:0", "x: float needs LO:HI");
  expect_refused("x", "'x' is not name=kind:args");
}

/* A search keeps its options' promises: a seed gives the same run, another
 * seed another; every value within its bounds; best is the lowest loss. */
static void test_search_properties(void **state) {
  (void)state;
  ddp_hpo_space *s;
  assert_int_equal(ddp_hpo_space_parse("act=cat:relu|sigmoid|tanh,lr=logfloat:1e-4:1e-2,"
                                       "layers=int:2:10",
                                       &s),
                   DDP_OK);
  ddp_hpo_options o = ddp_hpo_defaults();
  o.generations = 200;
  o.seed = 3;
  ddp_hpo_result a, b, c;
  assert_int_equal(ddp_hpo_search(s, &o, mixed, NULL, &a), DDP_OK);
  assert_int_equal(ddp_hpo_search(s, &o, mixed, NULL, &b), DDP_OK);
  o.seed = 4;
  assert_int_equal(ddp_hpo_search(s, &o, mixed, NULL, &c), DDP_OK);
  bool differs = false;
  for (int64_t i = 0; i < a.count; i++) {
    assert_memory_equal(a.individuals[i].values, b.individuals[i].values, 3 * sizeof(double));
    differs |= memcmp(a.individuals[i].values, c.individuals[i].values, 3 * sizeof(double)) != 0;
    const double *v = a.individuals[i].values;
    assert_true(v[0] >= 0 && v[0] <= 2 && v[0] == floor(v[0]));
    assert_true(v[2] >= 2 && v[2] <= 10 && v[2] == floor(v[2]));
    assert_true(v[1] >= 1e-4 && v[1] <= 1e-2);
    assert_true(a.individuals[i].loss >= a.individuals[a.best].loss);
  }
  assert_true(differs);
  /* The search found the optimum's neighbourhood: layers 5, lr near 1e-3, relu. */
  assert_true(a.individuals[a.best].loss < 0.05);
  ddp_hpo_result_free(&a);
  ddp_hpo_result_free(&b);
  ddp_hpo_result_free(&c);
  ddp_hpo_space_destroy(s);
}

/* ---- checkpoints ---------------------------------------------------------- */

#include <sys/stat.h>
#include <unistd.h>

static void remove_dir(const char *dir) {
  char cmd[4200];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
}

/* 150 generations, then the same search resumed to 300, equal bit for bit
 * one run of 300 (the journal restores the population and the generator);
 * a torn journal tail loses only what came after the last commit, which
 * is evaluated again the same way; a directory holding a search is refused
 * without resume, and with other options, naming the difference. */
static void test_checkpoint_resume(void **state) {
  (void)state;
  char dir[] = "/tmp/ddp-hpo-ckpt-XXXXXX";
  assert_non_null(mkdtemp(dir));
  ddp_hpo_space *s;
  assert_int_equal(ddp_hpo_space_parse(problems[1].space, &s), DDP_OK);
  ddp_hpo_options o = ddp_hpo_defaults();
  o.generations = 300;
  o.pop_size = 6;
  o.seed = 7;
  ddp_hpo_result straight, first, resumed;
  assert_int_equal(ddp_hpo_search(s, &o, mixed, NULL, &straight), DDP_OK);
  o.checkpoint_dir = dir;
  o.checkpoint_interval_s = 0; /* a commit per generation */
  o.generations = 150;
  if (ddp_hpo_search(s, &o, mixed, NULL, &first) != DDP_OK) fail_msg("%s", ddp_last_error());
  assert_int_equal(first.count, 150);
  /* Without resume: refused, naming the directory. */
  assert_int_equal(ddp_hpo_search(s, &o, mixed, NULL, &resumed), DDP_ERR_STATE);
  assert_non_null(strstr(ddp_last_error(), "holds a search already"));
  /* Other options: refused, naming the first difference. */
  o.resume = true;
  o.pop_size = 4;
  assert_int_equal(ddp_hpo_search(s, &o, mixed, NULL, &resumed), DDP_ERR_INVALID);
  assert_non_null(strstr(ddp_last_error(), "'pop_size=6' (saved) against 'pop_size=4' (now)"));
  o.pop_size = 6;
  /* A torn tail: the last generation's records half written. */
  char journal[4200];
  snprintf(journal, sizeof journal, "%s/worker-0.journal", dir);
  struct stat st;
  assert_int_equal(stat(journal, &st), 0);
  assert_int_equal(truncate(journal, st.st_size - 100), 0);
  o.generations = 300;
  if (ddp_hpo_search(s, &o, mixed, NULL, &resumed) != DDP_OK) fail_msg("%s", ddp_last_error());
  assert_int_equal(resumed.count, 300);
  for (int64_t i = 0; i < 300; i++) {
    assert_int_equal(resumed.individuals[i].generation, i);
    assert_memory_equal(resumed.individuals[i].values, straight.individuals[i].values,
                        3 * sizeof(double));
    assert_true(resumed.individuals[i].loss == straight.individuals[i].loss);
  }
  /* Resumed once more: finished, nothing new. */
  ddp_hpo_result again;
  assert_int_equal(ddp_hpo_search(s, &o, mixed, NULL, &again), DDP_OK);
  assert_int_equal(again.count, 300);
  ddp_hpo_result_free(&again);
  ddp_hpo_result_free(&straight);
  ddp_hpo_result_free(&first);
  ddp_hpo_result_free(&resumed);
  ddp_hpo_space_destroy(s);
  remove_dir(dir);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_checkpoint_resume),
      cmocka_unit_test(test_reproduces_propulate),
      cmocka_unit_test(test_reproduces_propulate_migration_draw),
      cmocka_unit_test(test_space_parser),
      cmocka_unit_test(test_search_properties),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
