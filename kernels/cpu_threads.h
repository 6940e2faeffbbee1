/* The threads of the compiled CPU kernels: `run_parallel(task, arg, count)` splits a call into `count` shares and
 * runs task(arg, index, count) for each, on the calling thread and the threads of a pool. Included by every
 * kernels/cpu_*.c (kernels/cpu_build.py keys each build by this header too); each kernel library keeps its own pool.
 *
 * Why a pool: starting and joining a thread costs tens to hundreds of microseconds (the more, the busier the
 * machine), and a decode step makes about ten kernel calls a layer. Pool threads
 * are started on the first call that wants them and kept; between calls they sleep on a futex, so an idle engine
 * (or another library's pool at work) gets every core.
 *
 * Why shares are claimed: whoever is awake takes the next share, the caller included. A pool thread the OS has not
 * run yet (the machine busy with other work) then delays nobody: the caller computes its shares, where a fixed
 * assignment would wait for that thread as an OpenMP barrier does. The caller waits only for shares already begun,
 * spinning up to POOL_CALLER_SPIN_NS before it sleeps.
 *
 * Which thread computes which share never changes a result: the kernels are batch-invariant by construction, every
 * output computed by one thread in a fixed order. Where the pool cannot serve a call (another thread of the process
 * is using it right now: ctypes releases the GIL), the call is one share, computed by the caller; so it is without
 * Linux's futex. */
#ifndef KVSTRATA_CPU_THREADS_H
#define KVSTRATA_CPU_THREADS_H

#include <pthread.h>
#include <stdint.h>

/* One share of a call's work: returns 0, or a kernel's nonzero error code (the call returns one of them). */
typedef int (*ParallelTask)(void *arg, int index, int count);

#ifdef __linux__
#include <limits.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define POOL_MAX_THREADS 256
#define POOL_CALLER_SPIN_NS 20000  /* how long the caller waits for the others' shares before it sleeps */

typedef struct {
    pthread_mutex_t busy;      /* held for a whole call: one call at a time uses the pool */
    int started;               /* pool threads running */
    atomic_int call;           /* the call's serial number, bumped to start one: the pool threads' futex word */
    /* the call's serial (high 32 bits), share count (16) and next unclaimed share (low 16): whoever is awake claims
     * the next share, the caller included, so a pool thread the OS has not run yet delays nobody */
    _Atomic uint64_t shares;
    atomic_int done;           /* the call's shares computed; the caller's futex word */
    atomic_int status;         /* the first nonzero share status of the call */
    ParallelTask task;
    void *arg;
} Pool;

static Pool pool = {.busy = PTHREAD_MUTEX_INITIALIZER};

/* A pool thread's start: the call word as it stood before the thread was started, so that it helps with the call
 * that started it however late it first runs. */
static int pool_starts[POOL_MAX_THREADS];

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#else
    atomic_signal_fence(memory_order_seq_cst);
#endif
}

static int64_t monotonic_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void futex_wait(atomic_int *word, int expected) {
    syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);   /* returns at once if changed */
}

static void futex_wake_all(atomic_int *word) {
    syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

static void note_status(int status) {
    int ok = 0;
    if (status != 0) atomic_compare_exchange_strong(&pool.status, &ok, status);
}

/* The next unclaimed share of call `serial`, claimed (its index; *count: the call's share count), or -1 where none
 * is left or the call is another one (a thread woken late for a call already over). */
static int claim_share(uint32_t serial, int *count) {
    uint64_t word = atomic_load(&pool.shares);
    for (;;) {
        const int n = (int)((word >> 16) & 0xffff), next = (int)(word & 0xffff);
        if ((uint32_t)(word >> 32) != serial || next >= n) return -1;
        if (atomic_compare_exchange_weak(&pool.shares, &word, word + 1)) {
            *count = n;
            return next;
        }
    }
}

/* Computes shares of call `serial` until none is left unclaimed. A claimed share's task and arg are its call's: the
 * call does not end, so nothing overwrites them, until every claimed share is done. */
static void run_shares(uint32_t serial) {
    int index, count;
    while ((index = claim_share(serial, &count)) >= 0) {
        note_status(pool.task(pool.arg, index, count));
        if (atomic_fetch_add(&pool.done, 1) + 1 == count) futex_wake_all(&pool.done);
    }
}

static void *pool_thread(void *arg) {
    int seen = *(const int *)arg;
    for (;;) {
        int now;
        while ((now = atomic_load(&pool.call)) == seen) futex_wait(&pool.call, seen);
        seen = now;
        run_shares((uint32_t)now);
    }
    return NULL;
}

/* A forked child has the parent's pool state but none of its threads: it starts its own. */
static void pool_after_fork(void) {
    pthread_mutex_init(&pool.busy, NULL);
    pool.started = 0;
}

/* Pool threads up to `wanted` (where they can be started). */
static void pool_grow(int wanted) {
    static int fork_handled = 0;
    if (!fork_handled) fork_handled = pthread_atfork(NULL, NULL, pool_after_fork) == 0;
    while (pool.started < wanted) {
        pthread_t id;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int *start = &pool_starts[pool.started];
        *start = atomic_load(&pool.call);
        int failed = pthread_create(&id, &attr, pool_thread, start);
        pthread_attr_destroy(&attr);
        if (failed) break;
        pool.started++;
    }
}

/* Runs task(arg, i, count) for every i in [0, count) on up to `count` threads, the caller's one of them (any share
 * no pool thread has claimed, the caller computes); returns 0 or the first nonzero share status. */
static int run_parallel(ParallelTask task, void *arg, int count) {
    if (count > POOL_MAX_THREADS) count = POOL_MAX_THREADS;
    if (count <= 1 || pthread_mutex_trylock(&pool.busy) != 0)
        return task(arg, 0, 1);   /* one thread wanted, or the pool busy with another call: one share, the caller's */
    pool_grow(count - 1);
    const uint32_t serial = (uint32_t)atomic_load(&pool.call) + 1u;
    pool.task = task;
    pool.arg = arg;
    atomic_store(&pool.status, 0);
    atomic_store(&pool.done, 0);
    /* the shares word publishes the fields above to whoever claims a share */
    atomic_store(&pool.shares, ((uint64_t)serial << 32) | ((uint64_t)count << 16));
    atomic_store(&pool.call, (int)serial);
    futex_wake_all(&pool.call);
    run_shares(serial);
    /* every share is claimed; those the others took usually end about when the caller's do: a short spin catches
     * them without a sleep and a wake-up */
    const int64_t spin_until = monotonic_ns() + POOL_CALLER_SPIN_NS;
    int done;
    while ((done = atomic_load(&pool.done)) != count) {
        if (monotonic_ns() < spin_until)
            for (int i = 0; i < 32; i++) cpu_relax();
        else
            futex_wait(&pool.done, done);
    }
    int status = atomic_load(&pool.status);
    pthread_mutex_unlock(&pool.busy);
    return status;
}

#else   /* no futex: every call is one share, the caller's (the same results, one thread) */
static int run_parallel(ParallelTask task, void *arg, int count) {
    (void)count;
    return task(arg, 0, 1);
}
#endif

#endif
