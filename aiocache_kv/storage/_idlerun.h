/* Page copies split into chunks that any of several threads claim (storage/_blocksum.c's
 * gather_sum and scatter_check), run without the GIL.
 *
 * Two ways to run a copy:
 *
 * - at once (relief_ns 0): the caller and threads-1 helpers claim chunks until none is left,
 *   as torch's own copy splits its work over its threads;
 * - on idle helpers (relief_ns > 0: the copy worker's, aiocache_kv/priority.py): up to
 *   ``threads`` helpers that put themselves under SCHED_IDLE claim the chunks while the caller
 *   (the copy worker, at nice +10) sleeps.  An idle thread takes a core only when no other
 *   thread of the machine wants it, so the event loop and the model always preempt it, and it
 *   never holds the GIL, so a preempted helper stalls nobody.  Relief: where the copy has not
 *   finished by its deadline (relief_ns after it started, or later for a large copy: when it
 *   would have at IR_FLOOR_BYTES_PER_S) the helpers are starved or crawl (the cores are busy
 *   with other work): the caller claims the chunks left itself, at its own priority.  A copy
 *   of IR_INLINE_BYTES or less runs on the caller.
 *
 * The process adapts to a busy machine: each relieved copy halves the next one's deadline, each
 * copy the helpers finish in time doubles it back (up to the full one), and a relief at the
 * shortest deadline runs every copy at once for a while (idle_ready() is false: the copy worker
 * copies the torch way meanwhile), after which copies probe the helpers again from the full
 * deadline; each hold that follows before a copy on the helpers succeeds is twice as long.  So a machine whose cores other processes keep busy copies about as fast
 * as at once, and one whose cores the loop and the model leave free copies on idle helpers.
 *
 * Idle helpers are a pool started once (each puts itself under SCHED_IDLE once) and woken per
 * copy; a run is posted to the pool's list and reference-counted: the caller returns once every
 * chunk has finished, which a helper that has not yet run (starved) need not wait for: it finds
 * no chunk to claim when it does run, and never touches the copy's buffers again.  A copy at
 * once starts its helpers for itself, detached, at the caller's priority. */
#ifndef AIOCACHE_KV_IDLERUN_H
#define AIOCACHE_KV_IDLERUN_H

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* bytes per claimed chunk (one page at least): small enough that the caller's relief finds
 * work left, large enough that a claim (one atomic add) costs nothing against the copy */
#define IR_CHUNK_BYTES (256 << 10)
/* a copy this small runs on the caller even with idle helpers: two wake-ups (posting to the
 * helpers, their completion waking the caller) cost about as much as copying it */
#define IR_INLINE_BYTES (1 << 20)
/* deadlines are the full one >> level, level 0..IR_MAX_LEVEL */
#define IR_MAX_LEVEL 3
/* a relief at IR_MAX_LEVEL: copies run at once for a hold (the cores are busy elsewhere),
 * IR_HOLD_MIN_NS first, doubled by each probe relieved in turn up to IR_HOLD_MAX_NS */
#define IR_HOLD_MIN_NS 100000000LL
#define IR_HOLD_MAX_NS 1600000000LL
#define IR_HELPER_STACK (256 << 10)
/* an idle helper done with a run looks for the next this long before it sleeps: back-to-back
 * copies then skip the wake-up (tens of microseconds), and spinning at idle priority takes a
 * core from nobody */
#define IR_SPIN_NS 200000LL
/* an idle copy slower than this (bytes per second) is starving: relieved at the latest when a
 * copy this fast would have finished (a copy runs at 2-10 GB/s on a free core) */
#define IR_FLOOR_BYTES_PER_S 500000000LL

typedef void (*ir_fn)(void *work, Py_ssize_t first, Py_ssize_t last);

typedef struct ir_run {
    ir_fn fn;
    void *work;
    Py_ssize_t count, per_chunk, chunks;
    Py_ssize_t next, finished; /* atomic: the next chunk to claim, chunks done */
    int refs;                  /* atomic: the caller, the pool's list, each helper on it */
    int idle;
    int dead;      /* atomic: the caller is done with it; the list drops it at its next prune */
    uint32_t done; /* atomic: 1 once every chunk finished (the caller's futex on Linux) */
#ifndef __linux__
    pthread_mutex_t mu; /* the completion's wait elsewhere (Linux: a futex on done) */
    pthread_cond_t cv;
#endif
    struct ir_run *prev, *link; /* the idle pool's list of runs with chunks to claim */
} ir_run;

/* process-wide: monotonic ns until which copies run at once, the deadline level; counters */
static int64_t ir_hold_until;
static int64_t ir_hold_ns = IR_HOLD_MIN_NS;
static int ir_level;
static uint64_t ir_idle_copies, ir_relieved_copies, ir_relieved_chunks;

/* The idle pool: helpers started once (on first need, up to GATHER_MAX_THREADS), each under
 * SCHED_IDLE for good, waiting for runs posted to ir_runs. */
static pthread_mutex_t ir_pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t ir_pool_cv = PTHREAD_COND_INITIALIZER;
static ir_run *ir_runs;
static int ir_pool_size;

static int64_t ir_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void ir_release(ir_run *r)
{
    if (__atomic_sub_fetch(&r->refs, 1, __ATOMIC_ACQ_REL) == 0) {
#ifndef __linux__
        pthread_cond_destroy(&r->cv);
        pthread_mutex_destroy(&r->mu);
#endif
        free(r);
    }
}

/* claim and run chunks until none is left; the number run */
static Py_ssize_t ir_claim(ir_run *r)
{
    Py_ssize_t ran = 0;
    for (;;) {
        Py_ssize_t c = __atomic_fetch_add(&r->next, 1, __ATOMIC_ACQ_REL);
        if (c >= r->chunks) {
            return ran;
        }
        Py_ssize_t first = c * r->per_chunk, last = first + r->per_chunk;
        r->fn(r->work, first, last < r->count ? last : r->count);
        ran++;
        if (__atomic_add_fetch(&r->finished, 1, __ATOMIC_ACQ_REL) == r->chunks) {
#ifdef __linux__
            /* no lock: an idle helper preempted holding one would stall its caller */
            __atomic_store_n(&r->done, 1, __ATOMIC_RELEASE);
            syscall(SYS_futex, &r->done, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
#else
            pthread_mutex_lock(&r->mu);
            __atomic_store_n(&r->done, 1, __ATOMIC_RELEASE);
            pthread_cond_broadcast(&r->cv);
            pthread_mutex_unlock(&r->mu);
#endif
        }
    }
}

/* drop the runs their callers are done with from the pool's list (ir_pool_mu held) */
static void ir_prune_locked(void)
{
    ir_run *r = ir_runs;
    while (r != NULL) {
        ir_run *link = r->link;
        if (__atomic_load_n(&r->dead, __ATOMIC_ACQUIRE)) {
            if (r->prev != NULL) {
                r->prev->link = link;
            } else {
                __atomic_store_n(&ir_runs, link, __ATOMIC_RELEASE);
            }
            if (link != NULL) {
                link->prev = r->prev;
            }
            ir_release(r); /* the list's reference */
        }
        r = link;
    }
}

/* an idle pool thread: take the first posted run with chunks left, help it, repeat */
static void *ir_pool_helper(void *arg)
{
    (void)arg;
#ifdef SCHED_IDLE
    struct sched_param p = {0};
    (void)sched_setscheduler(0, SCHED_IDLE, &p); /* refused: it helps at its priority */
#endif
    int spun = 0;
    pthread_mutex_lock(&ir_pool_mu);
    for (;;) {
        ir_prune_locked();
        ir_run *r = ir_runs;
        while (r != NULL && __atomic_load_n(&r->next, __ATOMIC_ACQUIRE) >= r->chunks) {
            r = r->link;
        }
        if (r == NULL) {
            if (!spun) {
                spun = 1;
                pthread_mutex_unlock(&ir_pool_mu);
                int64_t until = ir_now() + IR_SPIN_NS;
                while (__atomic_load_n(&ir_runs, __ATOMIC_ACQUIRE) == NULL && ir_now() < until) {
#if defined(__x86_64__) || defined(__i386__)
                    __builtin_ia32_pause();
#endif
                }
                pthread_mutex_lock(&ir_pool_mu);
                continue;
            }
            pthread_cond_wait(&ir_pool_cv, &ir_pool_mu);
            spun = 0;
            continue;
        }
        spun = 0;
        __atomic_add_fetch(&r->refs, 1, __ATOMIC_ACQ_REL);
        pthread_mutex_unlock(&ir_pool_mu);
        ir_claim(r);
        ir_release(r);
        pthread_mutex_lock(&ir_pool_mu);
    }
    return NULL;
}

/* a helper of a run at once (the caller's priority), for this run only */
static void *ir_helper(void *arg)
{
    ir_run *r = (ir_run *)arg;
    ir_claim(r);
    ir_release(r);
    return NULL;
}

static void ir_atfork_child(void)
{
    /* the pool's threads do not exist in a forked child: start afresh */
    pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
    ir_pool_mu = mu;
    ir_pool_cv = cv;
    ir_runs = NULL;
    ir_pool_size = 0;
}

static pthread_once_t ir_fork_once = PTHREAD_ONCE_INIT;

static void ir_register_fork(void)
{
    (void)pthread_atfork(NULL, NULL, ir_atfork_child);
}

static int ir_start_thread(void *(*fn)(void *), void *arg)
{
    pthread_attr_t attr;
    if (pthread_attr_init(&attr) != 0) {
        return 0;
    }
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, IR_HELPER_STACK);
    pthread_t tid;
    int ok = pthread_create(&tid, &attr, fn, arg) == 0;
    pthread_attr_destroy(&attr);
    return ok;
}

/* post ``r`` to the idle pool, grown to ``helpers`` threads; the number of pool threads, 0:
 * not posted.  The callers never block on the pool's lock: a helper holds it while it looks
 * for work, and one preempted there (idle: by anything) would hold it for as long as it
 * starves, so a caller that finds it taken copies at once instead. */
static int ir_post(ir_run *r, int helpers)
{
    pthread_once(&ir_fork_once, ir_register_fork);
    if (pthread_mutex_trylock(&ir_pool_mu) != 0) {
        return 0;
    }
    ir_prune_locked();
    while (ir_pool_size < helpers && ir_start_thread(ir_pool_helper, NULL)) {
        ir_pool_size++;
    }
    if (ir_pool_size == 0) {
        pthread_mutex_unlock(&ir_pool_mu);
        return 0;
    }
    __atomic_add_fetch(&r->refs, 1, __ATOMIC_ACQ_REL); /* the list's */
    r->prev = NULL;
    r->link = ir_runs;
    if (ir_runs != NULL) {
        ir_runs->prev = r;
    }
    __atomic_store_n(&ir_runs, r, __ATOMIC_RELEASE);
    int size = ir_pool_size;
    for (int k = 0; k < helpers; k++) {
        pthread_cond_signal(&ir_pool_cv);
    }
    pthread_mutex_unlock(&ir_pool_mu);
    return size;
}

/* the caller is done with posted ``r``: off the list now if the lock is free, else at the next
 * prune (a post's or a helper's); the list's reference keeps it until then */
static void ir_unpost(ir_run *r)
{
    __atomic_store_n(&r->dead, 1, __ATOMIC_RELEASE);
    if (pthread_mutex_trylock(&ir_pool_mu) == 0) {
        ir_prune_locked();
        pthread_mutex_unlock(&ir_pool_mu);
    }
}

/* Wait until every chunk of ``r`` finished (1), or ``ts`` (monotonic; NULL: no deadline)
 * passed (0).  On Linux a futex on r->done, no lock: under a CPU hog the condition variable's
 * timed wait overslept its deadline by hundreds of milliseconds while the helpers starved (a
 * plain futex or clock_nanosleep kept it), and an idle helper that signals under a lock could
 * be preempted holding it. */
static int ir_wait_done(ir_run *r, const struct timespec *ts)
{
#ifdef __linux__
    while (__atomic_load_n(&r->done, __ATOMIC_ACQUIRE) == 0) {
        long rc = syscall(SYS_futex, &r->done, FUTEX_WAIT_BITSET_PRIVATE, 0, ts, NULL,
                          FUTEX_BITSET_MATCH_ANY);
        if (rc != 0 && errno == ETIMEDOUT) {
            break;
        }
    }
    return __atomic_load_n(&r->done, __ATOMIC_ACQUIRE) != 0;
#else
    int timed_out = 0;
    pthread_mutex_lock(&r->mu);
    while (!timed_out && __atomic_load_n(&r->done, __ATOMIC_ACQUIRE) == 0) {
        if (ts == NULL) {
            pthread_cond_wait(&r->cv, &r->mu);
        } else {
            timed_out = pthread_cond_timedwait(&r->cv, &r->mu, ts) == ETIMEDOUT;
        }
    }
    pthread_mutex_unlock(&r->mu);
    return __atomic_load_n(&r->done, __ATOMIC_ACQUIRE) != 0;
#endif
}

/* Run fn over [0, count) (pages of page_bytes) in chunks over ``parts`` threads; relief_ns > 0
 * runs on idle helpers as above.  Returns once every chunk has run.  Never fails: a helper
 * that cannot start (or a run that cannot be allocated) leaves its chunks to the caller. */
static void ir_execute(ir_fn fn, void *work, Py_ssize_t count, Py_ssize_t page_bytes,
                       int parts, int64_t relief_ns)
{
    if (count <= 0) {
        return;
    }
    ir_run *r = (ir_run *)calloc(1, sizeof(ir_run));
    if (r == NULL) {
        fn(work, 0, count);
        return;
    }
    r->fn = fn;
    r->work = work;
    r->count = count;
    r->per_chunk = page_bytes >= IR_CHUNK_BYTES ? 1 : IR_CHUNK_BYTES / (page_bytes > 0 ? page_bytes : 1);
    r->chunks = (count + r->per_chunk - 1) / r->per_chunk;
    int64_t start = ir_now();
    r->idle = relief_ns > 0 && (double)count * (double)page_bytes > (double)IR_INLINE_BYTES &&
              start >= __atomic_load_n(&ir_hold_until, __ATOMIC_ACQUIRE);
    r->refs = 1;
#ifndef __linux__
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&r->cv, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_init(&r->mu, NULL);
#endif
    int helpers = r->idle ? parts : parts - 1; /* at once: the caller is one of the parts */
    if (helpers > r->chunks) {
        helpers = (int)r->chunks;
    }
    int posted = 0;
    if (r->idle) {
        posted = ir_post(r, helpers) > 0;
        if (posted) {
            __atomic_add_fetch(&ir_idle_copies, 1, __ATOMIC_RELAXED);
        }
    } else {
        for (int k = 0; k < helpers; k++) {
            __atomic_add_fetch(&r->refs, 1, __ATOMIC_ACQ_REL);
            if (!ir_start_thread(ir_helper, r)) {
                __atomic_sub_fetch(&r->refs, 1, __ATOMIC_ACQ_REL);
                break;
            }
        }
    }
    if (!r->idle || !posted) {
        ir_claim(r);
    }
    int relieved = 0;
    double floor_ns = (double)count * (double)page_bytes * 1e9 / (double)IR_FLOOR_BYTES_PER_S;
    int64_t wait = floor_ns > (double)relief_ns ? (int64_t)floor_ns : relief_ns;
    int level = __atomic_load_n(&ir_level, __ATOMIC_ACQUIRE);
    int64_t due = start + (wait >> level);
    struct timespec ts = {(time_t)(due / 1000000000LL), (long)(due % 1000000000LL)};
    if (r->idle && posted && !ir_wait_done(r, &ts)) {
        /* not done by its deadline: the helpers starve; take what is left */
        relieved = 1;
        if (level < IR_MAX_LEVEL) {
            __atomic_store_n(&ir_level, level + 1, __ATOMIC_RELEASE);
        } else {
            int64_t hold = __atomic_load_n(&ir_hold_ns, __ATOMIC_ACQUIRE);
            __atomic_store_n(&ir_hold_until, ir_now() + hold, __ATOMIC_RELEASE);
            __atomic_store_n(&ir_level, 0, __ATOMIC_RELEASE); /* the probe: the full deadline */
            __atomic_store_n(&ir_hold_ns, hold < IR_HOLD_MAX_NS ? 2 * hold : hold,
                             __ATOMIC_RELEASE);
        }
        Py_ssize_t ran = ir_claim(r);
        __atomic_add_fetch(&ir_relieved_chunks, (uint64_t)ran, __ATOMIC_RELAXED);
    }
    ir_wait_done(r, NULL); /* chunks helpers still copy (at once: its own helpers') */
    if (r->idle && posted) {
        ir_unpost(r); /* a helper still holding it has its own reference */
        if (!relieved) {
            if (level > 0) {
                __atomic_store_n(&ir_level, level - 1, __ATOMIC_RELEASE);
            }
            __atomic_store_n(&ir_hold_ns, IR_HOLD_MIN_NS, __ATOMIC_RELEASE);
        }
    }
    if (relieved) {
        __atomic_add_fetch(&ir_relieved_copies, 1, __ATOMIC_RELAXED);
    }
    ir_release(r);
}

/* idle_ready() -> whether a copy now would run on idle helpers (False: the process holds to
 * copies at once after its helpers starved) */
static PyObject *idle_ready(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyBool_FromLong(ir_now() >= __atomic_load_n(&ir_hold_until, __ATOMIC_ACQUIRE));
}

/* idle_forget() -> None: forget the process's starvation history (deadline level, hold) */
static PyObject *idle_forget(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    __atomic_store_n(&ir_level, 0, __ATOMIC_RELEASE);
    __atomic_store_n(&ir_hold_until, 0, __ATOMIC_RELEASE);
    __atomic_store_n(&ir_hold_ns, IR_HOLD_MIN_NS, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

/* idle_stats() -> (copies run on idle helpers, of them relieved by their caller, chunks the
 * callers took) since the process started */
static PyObject *idle_stats(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return Py_BuildValue("(KKK)", (unsigned long long)__atomic_load_n(&ir_idle_copies, __ATOMIC_RELAXED),
                         (unsigned long long)__atomic_load_n(&ir_relieved_copies, __ATOMIC_RELAXED),
                         (unsigned long long)__atomic_load_n(&ir_relieved_chunks, __ATOMIC_RELAXED));
}

#endif
