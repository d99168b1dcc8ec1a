/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_tier_mem.c - the host tier's memory (kvp_tier_mem.h). create reserves the whole range
 * (a memfd of its size mapped shared for the host backend, an anonymous mapping for the cuda
 * backend), binds it to a NUMA node when asked, and starts one thread that makes it usable
 * chunk by chunk: the memfd's pages allocated with fallocate (so a full tmpfs is an error code,
 * never a SIGBUS on a touch) and its page tables filled, the anonymous memory populated then
 * pinned with cudaHostRegister. Pinning a large pool takes seconds to minutes (the kernel
 * faults and locks every page, the driver maps it for the device); chunking lets the slot
 * mover use the ready prefix while the rest is pinned, and lets destroy stop it between chunks.
 * The thread only calls cudaSetDevice and cudaHostRegister, which take no stream and wait for
 * no work, so copies and appends on other threads run meanwhile.
 */
#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "kvp_backend.h"
#include "kvp_error.h"
#include "kvp_log.h"
#include "kvp_tier_mem.h"

#ifdef KVP_HAVE_CUDA
#include "kvp_cuda_util.h"
#endif

#define DEFAULT_CHUNK_BYTES (1ull << 30)
#define MPOL_BIND_MODE      2    /* linux/mempolicy.h's MPOL_BIND */
#define NUMA_MASK_BITS      1024 /* the nodes a mask here can name */

struct kvp_tier_mem {
    int cuda; /* the backend's kind is KVP_BACKEND_CUDA */
    int ordinal;
    int fd; /* host backend: the memfd; -1 otherwise */
    uint8_t *base;
    uint64_t map_bytes; /* nslots * slot_bytes rounded up to the page size */
    uint64_t nslots, slot_bytes, chunk_slots;
    uint64_t pinned_chunks; /* cuda: chunks registered (the thread's; read after the join) */
    _Atomic uint64_t ready;
    atomic_int done, error, stop;
    pthread_t thread;
    int thread_started;
};

static uint64_t gcd_u64(uint64_t a, uint64_t b)
{
    while (b) {
        uint64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Makes the page tables of [p, p + len) present and writable: MADV_POPULATE_WRITE (Linux 5.14),
 * or a write to every page where the kernel does not know it. The memory exists (fallocated)
 * or is anonymous, so the touch cannot SIGBUS. */
static int populate(uint8_t *p, uint64_t len, long page)
{
    if (madvise(p, len, MADV_POPULATE_WRITE) == 0)
        return 0;
    if (errno != EINVAL)
        return errno == ENOMEM || errno == EFAULT || errno == EHWPOISON ? KVP_ENOMEM : -errno;
    for (uint64_t off = 0; off < len; off += (uint64_t)page)
        ((volatile uint8_t *)p)[off] = 0; /* the bytes are zero already: nothing changes */
    return 0;
}

/* Makes chunk [off, off + len) of the range usable. */
static int chunk_ready(kvp_tier_mem_t *m, uint64_t off, uint64_t len, long page)
{
    int rc = 0;
    if (m->fd >= 0 && fallocate(m->fd, 0, (off_t)off, (off_t)len) < 0)
        return errno == ENOSPC || errno == ENOMEM ? KVP_ENOMEM : -errno;
    if ((rc = populate(m->base + off, len, page)))
        return rc;
#ifdef KVP_HAVE_CUDA
    if (m->cuda) {
        /* portable: any context may copy from it; mapped: a kernel may reach it too */
        KVP_CUDA_TRY(cudaHostRegister(m->base + off, (size_t)len,
                                      cudaHostRegisterPortable | cudaHostRegisterMapped),
                     rc, fail);
        m->pinned_chunks++;
    }
fail:
#endif
    return rc;
}

static void *ready_main(void *arg)
{
    kvp_tier_mem_t *m = arg;
    const long page = sysconf(_SC_PAGESIZE);
    const double t0 = now_s();
    int rc = 0;
#ifdef KVP_HAVE_CUDA
    if (m->cuda)
        KVP_CUDA_TRY(cudaSetDevice(m->ordinal), rc, out);
#endif
    for (uint64_t s = 0; s < m->nslots && !rc && !atomic_load(&m->stop);) {
        const uint64_t e = m->nslots - s < m->chunk_slots ? m->nslots : s + m->chunk_slots;
        const uint64_t off = s * m->slot_bytes;
        const uint64_t end = e == m->nslots ? m->map_bytes : e * m->slot_bytes;
        if ((rc = chunk_ready(m, off, end - off, page)))
            break;
        atomic_store_explicit(&m->ready, e, memory_order_release);
        s = e;
    }
#ifdef KVP_HAVE_CUDA
out:
#endif
    if (rc) {
        atomic_store(&m->error, rc);
        kvp_log(KVP_LOG_ERR, "host tier stopped growing ready_slots=%llu nslots=%llu err=%s",
                (unsigned long long)atomic_load(&m->ready), (unsigned long long)m->nslots,
                kvp_errname(rc));
    } else {
        kvp_log(KVP_LOG_INFO, "host tier %s ready_slots=%llu nslots=%llu bytes=%llu seconds=%.2f",
                atomic_load(&m->stop) ? "stopped" : "ready",
                (unsigned long long)atomic_load(&m->ready), (unsigned long long)m->nslots,
                (unsigned long long)(atomic_load(&m->ready) * m->slot_bytes), now_s() - t0);
    }
    atomic_store(&m->done, 1);
    return NULL;
}

/* Binds [base, base + bytes) to one node before anything is allocated in it. */
static int bind_node(void *base, uint64_t bytes, int node)
{
    unsigned long mask[NUMA_MASK_BITS / (8 * sizeof(unsigned long))];
    memset(mask, 0, sizeof(mask));
    mask[(unsigned)node / (8 * sizeof(unsigned long))] |=
        1ul << ((unsigned)node % (8 * sizeof(unsigned long)));
    /* maxnode counts one more than the mask's bits (the kernel drops one, as libnuma knows) */
    if (syscall(SYS_mbind, base, (unsigned long)bytes, MPOL_BIND_MODE, mask,
                (unsigned long)NUMA_MASK_BITS + 1, 0u) == 0)
        return 0;
    int err = errno;
    kvp_log(KVP_LOG_ERR, "host tier mbind failed numa_node=%d err=%s", node, kvp_errname(-err));
    return err == EINVAL ? KVP_EINVAL : -err;
}

int kvp_tier_mem_create(kvp_backend_t *b, uint64_t nslots, uint64_t slot_bytes,
                        uint64_t chunk_bytes, int numa_node, kvp_tier_mem_t **out)
{
    if (!b || !out || !nslots || !slot_bytes || slot_bytes < kvp_backend_slot_bytes(b) ||
        numa_node < -1 || numa_node >= NUMA_MASK_BITS || nslots > UINT64_MAX / slot_bytes ||
        (b->kind != KVP_BACKEND_HOST && b->kind != KVP_BACKEND_CUDA))
        return KVP_EINVAL;
    const uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    const uint64_t total = nslots * slot_bytes;
    if (total > (uint64_t)SIZE_MAX - page || total > (uint64_t)INT64_MAX - page)
        return KVP_EINVAL;
    int ordinal = -1;
    if (b->kind == KVP_BACKEND_CUDA) {
#ifdef KVP_HAVE_CUDA
        void *pool;
        if (kvp_backend_cuda_device(b, 0, &ordinal, &pool))
            return KVP_EINVAL;
#else
        return KVP_EUNAVAIL;
#endif
    }
    kvp_tier_mem_t *m = calloc(1, sizeof(*m));
    if (!m)
        return KVP_ENOMEM;
    m->cuda = b->kind == KVP_BACKEND_CUDA;
    m->ordinal = ordinal;
    m->fd = -1;
    m->nslots = nslots;
    m->slot_bytes = slot_bytes;
    m->map_bytes = (total + page - 1) / page * page;
    /* whole slots, at least one, then enough of them that every chunk ends on a page boundary
     * (cudaHostRegister and madvise work on whole pages; two chunks must not share one) */
    uint64_t cs = (chunk_bytes ? chunk_bytes : DEFAULT_CHUNK_BYTES) / slot_bytes;
    const uint64_t q = page / gcd_u64(slot_bytes, page);
    cs = cs ? cs : 1;
    cs = cs > nslots ? nslots : cs;
    cs = (cs + q - 1) / q * q;
    m->chunk_slots = cs > nslots ? nslots : cs; /* one chunk: it ends where the mapping does */
    atomic_init(&m->ready, 0);
    atomic_init(&m->done, 0);
    atomic_init(&m->error, 0);
    atomic_init(&m->stop, 0);
    int rc = 0;
    if (!m->cuda) {
        m->fd = memfd_create("kvpool-host-tier", MFD_CLOEXEC);
        if (m->fd < 0 || ftruncate(m->fd, (off_t)m->map_bytes) < 0) {
            rc = errno == ENOMEM ? KVP_ENOMEM : -errno;
            goto fail;
        }
        m->base = mmap(NULL, m->map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, m->fd, 0);
    } else {
        m->base = mmap(NULL, m->map_bytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    }
    if (m->base == MAP_FAILED) {
        m->base = NULL;
        rc = KVP_ENOMEM;
        goto fail;
    }
    /* fewer pages for the kernel to fault and lock and the device to map (a hint) */
    if (m->cuda)
        (void)madvise(m->base, m->map_bytes, MADV_HUGEPAGE);
    if (numa_node >= 0 && (rc = bind_node(m->base, m->map_bytes, numa_node)))
        goto fail;
    kvp_log(KVP_LOG_INFO,
            "host tier reserved backend=%s nslots=%llu slot_bytes=%llu bytes=%llu chunk_slots=%llu "
            "numa_node=%d",
            m->cuda ? "cuda" : "host", (unsigned long long)nslots, (unsigned long long)slot_bytes,
            (unsigned long long)m->map_bytes, (unsigned long long)m->chunk_slots, numa_node);
    if (pthread_create(&m->thread, NULL, ready_main, m)) {
        rc = KVP_ENOMEM;
        goto fail;
    }
    m->thread_started = 1;
    *out = m;
    return 0;
fail:
    kvp_tier_mem_destroy(m);
    return rc;
}

uint64_t kvp_tier_mem_ready_slots(const kvp_tier_mem_t *m)
{
    return atomic_load_explicit(&((kvp_tier_mem_t *)m)->ready, memory_order_acquire);
}

uint64_t kvp_tier_mem_nslots(const kvp_tier_mem_t *m)
{
    return m->nslots;
}

uint64_t kvp_tier_mem_ready_bytes(const kvp_tier_mem_t *m)
{
    return kvp_tier_mem_ready_slots(m) * m->slot_bytes;
}

int kvp_tier_mem_done(const kvp_tier_mem_t *m)
{
    return atomic_load(&((kvp_tier_mem_t *)m)->done);
}

int kvp_tier_mem_error(const kvp_tier_mem_t *m)
{
    return atomic_load(&((kvp_tier_mem_t *)m)->error);
}

void *kvp_tier_mem_slot(const kvp_tier_mem_t *m, uint64_t i)
{
    assert(i < m->nslots);
    return m->base + i * m->slot_bytes;
}

void kvp_tier_mem_destroy(kvp_tier_mem_t *m)
{
    if (!m)
        return;
    if (m->thread_started) {
        atomic_store(&m->stop, 1);
        pthread_join(m->thread, NULL);
    }
#ifdef KVP_HAVE_CUDA
    if (m->pinned_chunks) {
        /* a failure is logged and the next chunk still tried; the unmap releases the pages */
        cudaError_t e = cudaSetDevice(m->ordinal);
        if (e != cudaSuccess)
            (void)KVP_CUDA_FAILED(e, "cudaSetDevice(tier)");
        const uint64_t chunk = m->chunk_slots * m->slot_bytes;
        for (uint64_t k = 0; k < m->pinned_chunks; k++)
            if ((e = cudaHostUnregister(m->base + k * chunk)) != cudaSuccess)
                (void)KVP_CUDA_FAILED(e, "cudaHostUnregister(tier chunk)");
    }
#endif
    if (m->base)
        munmap(m->base, m->map_bytes);
    if (m->fd >= 0)
        close(m->fd);
    free(m);
}
