/* jbench CPU read-bandwidth probe: all threads stream their share of a buffer much larger than the
 * last-level cache with 16-byte vector loads, as a CPU LLM decode streams its weights. Prints one JSON
 * object. Built on the device with its own C compiler by jbench calibrate.
 *
 * usage: cpu_read SIZE_MB THREADS RUNS   (THREADS 0: the online cores)
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef uint64_t vec16 __attribute__((vector_size(16)));

struct worker {
    pthread_t tid;
    const vec16 *base;
    size_t n;  /* vectors in this thread's slice */
    vec16 acc;
};

static pthread_barrier_t start_line, finish_line;
static int runs_total;

static void *work(void *arg) {
    struct worker *w = arg;
    /* First touch by the reading thread places its pages near it (NUMA). */
    memset((void *)w->base, 0x5a, w->n * sizeof(vec16));
    vec16 a = {0, 0}, b = a, c = a, d = a;
    for (int r = 0; r <= runs_total; r++) {  /* run 0 warms up */
        pthread_barrier_wait(&start_line);
        const vec16 *p = w->base;
        size_t i = 0;
        for (; i + 4 <= w->n; i += 4) {
            a ^= p[i]; b ^= p[i + 1]; c ^= p[i + 2]; d ^= p[i + 3];
        }
        for (; i < w->n; i++) a ^= p[i];
        pthread_barrier_wait(&finish_line);
    }
    w->acc = a ^ b ^ c ^ d;  /* keeps the loads live */
    return NULL;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc != 4) { fprintf(stderr, "usage: %s SIZE_MB THREADS RUNS\n", argv[0]); return 2; }
    size_t size = (size_t)atol(argv[1]) << 20;
    int threads = atoi(argv[2]);
    runs_total = atoi(argv[3]);
    if (threads == 0) threads = (int)sysconf(_SC_NPROCESSORS_ONLN);
    if (size < (16u << 20) || threads < 1 || threads > 1024 || runs_total < 1 || runs_total > 100) {
        fprintf(stderr, "SIZE_MB >= 16, 1 <= THREADS <= 1024, 1 <= RUNS <= 100\n");
        return 2;
    }
    size_t nvec = size / sizeof(vec16);
    vec16 *buf;
    if (posix_memalign((void **)&buf, 4096, nvec * sizeof(vec16)) != 0) { fprintf(stderr, "out of memory\n"); return 2; }
    struct worker *ws = calloc(threads, sizeof *ws);
    pthread_barrier_init(&start_line, NULL, threads + 1);
    pthread_barrier_init(&finish_line, NULL, threads + 1);
    size_t per = nvec / threads;
    for (int t = 0; t < threads; t++) {
        ws[t].base = buf + per * t;
        ws[t].n = (t == threads - 1) ? nvec - per * t : per;
        pthread_create(&ws[t].tid, NULL, work, &ws[t]);
    }
    double *gbs = calloc(runs_total, sizeof(double));
    for (int r = 0; r <= runs_total; r++) {
        pthread_barrier_wait(&start_line);
        double t0 = now();
        pthread_barrier_wait(&finish_line);
        double dt = now() - t0;
        if (r > 0) gbs[r - 1] = (double)(nvec * sizeof(vec16)) / dt / 1e9;
    }
    uint64_t sink = 0;
    for (int t = 0; t < threads; t++) {
        pthread_join(ws[t].tid, NULL);
        sink ^= ws[t].acc[0] ^ ws[t].acc[1];
    }
    printf("{\"probe\": \"c-read\", \"threads\": %d, \"buffer_bytes\": %zu, \"checksum\": %llu, \"read_gbs\": [",
           threads, nvec * sizeof(vec16), (unsigned long long)sink);
    for (int r = 0; r < runs_total; r++) printf("%s%.3f", r ? ", " : "", gbs[r]);
    printf("]}\n");
    return 0;
}
