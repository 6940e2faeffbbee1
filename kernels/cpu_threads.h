/* The threads of the compiled CPU kernels: `run_parallel(task, arg, count)` runs task(arg, index, count) for every
 * index in [0, count), the calling thread taking index 0 and pool threads the others. Included by every
 * kernels/cpu_*.c (kernels/cpu_build.py keys each build by this header too); each kernel library keeps its own pool.
 *
 * Why a pool: starting and joining a thread costs tens to hundreds of microseconds (measured on a 2-core VM: 27 us
 * while quiet, ~240 us beside a test suite), and a decode step makes about ten kernel calls a layer. Pool threads are started on the first call
 * that wants them and kept; between calls they sleep on a futex, so an idle engine (or another library's pool
 * at work) gets every core. Waking one costs a few microseconds. The caller, done with its own share, spins up to
 * 20 us for the others' before it sleeps too.
 *
 * Which thread runs which index never changes a result: the kernels are batch-invariant by construction, every
 * output computed by one thread in a fixed order. So where the pool cannot serve a call (a pool thread could not
 * be started, or another thread of the process is using the pool right now: ctypes releases the GIL), the call
 * runs on fewer threads, down to the caller alone, with the same results. Without Linux's futex every call runs on
 * the caller alone. */
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

#define POOL_MAX_THREADS 256      /* < 1 << POOL_COUNT_BITS */
#define POOL_COUNT_BITS 9          /* a call's thread count, in the low bits of its futex word */
#define POOL_CALLER_SPIN_NS 20000  /* how long the caller waits for the others' shares before it sleeps */

typedef struct {
    pthread_mutex_t busy;      /* held for a whole call: one call at a time uses the pool */
    int started;               /* pool threads running (indices 1 ..= started) */
    /* the pool threads' futex word: the call's serial number above POOL_COUNT_BITS, its thread count below, so a
     * thread decides whether it takes part from the very value that woke it */
    atomic_int call;
    atomic_int pending;        /* the call's pool threads not yet done; the caller's futex word */
    atomic_int status;         /* the first nonzero share status of the call */
    ParallelTask task;
    void *arg;
} Pool;

static Pool pool = {.busy = PTHREAD_MUTEX_INITIALIZER};

/* A pool thread's start: its index, and the call word as it stood before it was started, so that it takes part in
 * the call that started it however late it first runs. */
typedef struct {
    int index, seen;
} PoolStart;

static PoolStart pool_starts[POOL_MAX_THREADS];

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

static void *pool_thread(void *arg) {
    const int index = ((const PoolStart *)arg)->index;
    int seen = ((const PoolStart *)arg)->seen;
    for (;;) {
        int now;
        while ((now = atomic_load(&pool.call)) == seen) futex_wait(&pool.call, seen);
        seen = now;
        const int count = now & ((1 << POOL_COUNT_BITS) - 1);
        if (index >= count) continue;   /* a call of fewer threads: not this one's */
        note_status(pool.task(pool.arg, index, count));
        if (atomic_fetch_sub(&pool.pending, 1) == 1) futex_wake_all(&pool.pending);
    }
    return NULL;
}

/* A forked child has the parent's pool state but none of its threads: it starts its own. */
static void pool_after_fork(void) {
    pthread_mutex_init(&pool.busy, NULL);
    pool.started = 0;
}

/* Pool threads up to `wanted`; returns how many run. */
static int pool_grow(int wanted) {
    static int fork_handled = 0;
    if (!fork_handled) fork_handled = pthread_atfork(NULL, NULL, pool_after_fork) == 0;
    while (pool.started < wanted) {
        pthread_t id;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        PoolStart *start = &pool_starts[pool.started + 1];
        *start = (PoolStart){pool.started + 1, atomic_load(&pool.call)};
        int failed = pthread_create(&id, &attr, pool_thread, start);
        pthread_attr_destroy(&attr);
        if (failed) break;
        pool.started++;
    }
    return pool.started;
}

/* Runs task(arg, i, n) for i in [0, n), n <= count, on n threads (the caller's first); returns 0 or the first
 * nonzero share status. */
static int run_parallel(ParallelTask task, void *arg, int count) {
    if (count > POOL_MAX_THREADS) count = POOL_MAX_THREADS;   /* pool threads take indices 1 .. POOL_MAX_THREADS - 1 */
    if (count <= 1 || pthread_mutex_trylock(&pool.busy) != 0)
        return task(arg, 0, 1);   /* one thread wanted, or the pool busy with another call: the caller alone */
    const int n = 1 + (pool_grow(count - 1) < count - 1 ? pool.started : count - 1);
    if (n == 1) {
        pthread_mutex_unlock(&pool.busy);
        return task(arg, 0, 1);
    }
    pool.task = task;
    pool.arg = arg;
    atomic_store(&pool.status, 0);
    atomic_store(&pool.pending, n - 1);
    /* the next serial number with this call's count; the store publishes the fields above to the threads */
    int serial = (int)(((unsigned)atomic_load(&pool.call) >> POOL_COUNT_BITS) + 1u);
    atomic_store(&pool.call, (int)(((unsigned)serial << POOL_COUNT_BITS) | (unsigned)n));
    futex_wake_all(&pool.call);
    note_status(task(arg, 0, n));
    /* the shares are usually alike, so the others finish about when the caller does: a short spin catches them
     * without a sleep and a wake-up */
    const int64_t spin_until = monotonic_ns() + POOL_CALLER_SPIN_NS;
    int left;
    while ((left = atomic_load(&pool.pending)) != 0) {
        if (monotonic_ns() < spin_until)
            for (int i = 0; i < 32; i++) cpu_relax();
        else
            futex_wait(&pool.pending, left);
    }
    int status = atomic_load(&pool.status);
    pthread_mutex_unlock(&pool.busy);
    return status;
}

#else   /* no futex: the caller computes every call alone (the same results, one thread) */
static int run_parallel(ParallelTask task, void *arg, int count) {
    (void)count;
    return task(arg, 0, 1);
}
#endif

#endif
