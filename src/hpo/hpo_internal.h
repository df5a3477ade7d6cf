/* The search's parts (src/hpo/): CPython's sample and shuffle over indices,
 * the breeding of one child. Internal: never installed. */
#ifndef DDP_SRC_HPO_INTERNAL_H
#define DDP_SRC_HPO_INTERNAL_H

#include "ddp/core.h"
#include "ddp/hpo.h"

/* CPython 3.11's random.sample(population, k) over indices 0..n-1: out gets
 * the k chosen indices in CPython's order. Scratch: pool (n entries) when
 * ddp__pyrandom_sample_uses_pool(n, k), else taken (n flags). */
bool ddp__pyrandom_sample_uses_pool(int64_t n, int64_t k);
void ddp__pyrandom_sample(ddp_pyrandom *r, int64_t n, int64_t k, int64_t *out, int64_t *pool,
                          bool *taken);
void ddp__pyrandom_shuffle(ddp_pyrandom *r, int64_t *x, int64_t n);

/* The traits' names sorted (point mutation picks among them), indices into
 * the space. */
const int *ddp__hpo_space_sorted(const ddp_hpo_space *space);
/* The float-like traits (FLOAT, LOGFLOAT) in space order, and how many. */
const int *ddp__hpo_space_intervals(const ddp_hpo_space *space, int *count);

/* Breeds one child into `child` (one double per trait) as Propulate's
 * default propagator does, drawing from r. `n` individuals are active;
 * best[0..min(n, pop_size)) are the indices of the best of them by loss,
 * the earlier of equal losses first (what Propulate's stable sort of the
 * whole active population puts first), and values[i] is individual i's. */
void ddp__hpo_breed(const ddp_hpo_space *space, const ddp_hpo_options *o, ddp_pyrandom *r,
                    const double *const *values, int64_t n, const int64_t *best, double *child);

/* Keeps best[0..*count) (capacity cap) the cap lowest losses in (loss,
 * index) order after individual `index` with `loss` joins; indices only
 * grow, so a newcomer goes after every equal loss. O(cap). (A deactivated
 * member is replaced by rebuilding the list from the active ones.) */
void ddp__hpo_rank_insert(int64_t *best, double *best_loss, int *count, int cap, int64_t index,
                          double loss);

/* ---- The island's exchange (exchange.c) ---- */

typedef struct ddp__hpo_exchange ddp__hpo_exchange;

/* What workers tell each other. */
typedef enum ddp__hpo_kind {
  DDP__HPO_EVAL = 1,       /* an individual evaluated on `island` */
  DDP__HPO_MIGRANT = 2,    /* an individual going to `island` (its current: who answers for it) */
  DDP__HPO_DEACTIVATE = 3, /* on `island`, deactivate this individual (emigrated, replaced) */
} ddp__hpo_kind;

typedef struct ddp__hpo_message {
  int kind;   /* ddp__hpo_kind */
  int island; /* the island it concerns */
  ddp_hpo_individual ind;
} ddp__hpo_message;

/* Called for each message taken in (its values valid for the call only). */
typedef ddp_status (*ddp__hpo_arrival)(const ddp__hpo_message *m, void *user);

/* Worker `worker` of n_workers, individuals of `traits` values, room for
 * max_pending unsent records at first (the queue grows). Publishes this
 * worker's count (0): create it on every worker before the first poll
 * (a barrier between). */
ddp_status ddp__hpo_exchange_create(ddp_store *store, int worker, int n_workers, int traits,
                                    int64_t max_pending, ddp__hpo_exchange **out);
void ddp__hpo_exchange_destroy(ddp__hpo_exchange *x);
/* Queues a message for the other workers (also from a poll's callback). */
ddp_status ddp__hpo_exchange_send(ddp__hpo_exchange *x, const ddp__hpo_message *m);
/* Puts the queued records in the store (one round trip). */
ddp_status ddp__hpo_exchange_flush(ddp__hpo_exchange *x);
/* Takes in every record the others have put in the store since the last
 * poll, worker by worker in order; *received counts them. */
ddp_status ddp__hpo_exchange_poll(ddp__hpo_exchange *x, ddp__hpo_arrival fn, void *user,
                                  int64_t *received);
/* Records taken in so far, over every peer. */
int64_t ddp__hpo_exchange_seen(const ddp__hpo_exchange *x);

size_t ddp__hpo_record_bytes(int traits);
void ddp__hpo_record_encode(const ddp__hpo_message *m, int traits, unsigned char *out);
ddp_status ddp__hpo_record_decode(const void *data, size_t bytes, int traits, const char *key,
                                  ddp__hpo_message *m);

/* ---- Checkpoints (checkpoint.c) ---- */

/* Creates dir if needed; with a search.meta there: refused unless resume,
 * and then refused naming the first difference unless equal to `meta`
 * (*resuming true); without one, writes `meta` (atomically). */
ddp_status ddp__hpo_meta_check(const char *dir, const char *meta, bool resume, bool *resuming);

typedef struct ddp__hpo_journal ddp__hpo_journal;
ddp_status ddp__hpo_journal_open(const char *dir, int worker, int traits, bool resuming,
                                 ddp__hpo_arrival replay, void *user, ddp_pyrandom *rng,
                                 int64_t *generations_done, ddp__hpo_journal **out);
ddp_status ddp__hpo_journal_append(ddp__hpo_journal *j, const ddp__hpo_message *m);
ddp_status ddp__hpo_journal_commit(ddp__hpo_journal *j, int64_t generations_done,
                                   const ddp_pyrandom *rng);
void ddp__hpo_journal_close(ddp__hpo_journal *j);

#endif
