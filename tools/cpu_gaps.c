/* What this machine's cores lose to work not their own: a thread pinned to each core
 * reads the clock in a loop for SECONDS, and every gap of 10 us or more between two
 * reads is time the core spent elsewhere (interrupts, the kernel's threads, other
 * processes, the hypervisor). Prints, per core, the share of time lost and the gaps by
 * length; with JSON, writes the same figures there. Run it on an otherwise idle machine:
 * it reads the interference the simulator's `this-machine` preset stands in for
 * (net.cpu.Interference), not what a job's own ranks cost each other.
 *
 *     gcc -O2 -pthread tools/cpu_gaps.c -o /tmp/cpu_gaps && /tmp/cpu_gaps 10 gaps.json
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#define BINS 7
static const double EDGES[BINS + 1] = {10e-6, 50e-6, 200e-6, 1e-3, 3e-3, 10e-3, 30e-3, 1e9};

struct core {
    long id;
    double seconds;
    long gaps[BINS];
    double lost[BINS];
};

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void *watch(void *arg) {
    struct core *c = arg;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET((int)c->id, &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set);
    double last = now(), end = last + c->seconds;
    for (;;) {
        double t = now(), gap = t - last;
        last = t;
        if (t > end)
            break;
        if (gap >= EDGES[0]) {
            int i = 0;
            while (gap >= EDGES[i + 1])
                i++;
            c->gaps[i]++;
            c->lost[i] += gap;
        }
    }
    return NULL;
}

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 10.0;
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    if (!(seconds > 0) || n < 1) {
        fprintf(stderr, "usage: %s [SECONDS > 0] [JSON]\n", argv[0]);
        return 2;
    }
    struct core *cores = calloc((size_t)n, sizeof *cores);
    pthread_t *threads = calloc((size_t)n, sizeof *threads);
    if (!cores || !threads)
        return 1;
    for (long i = 0; i < n; i++) {
        cores[i].id = i;
        cores[i].seconds = seconds;
        pthread_create(&threads[i], NULL, watch, &cores[i]);
    }
    for (long i = 0; i < n; i++)
        pthread_join(threads[i], NULL);
    FILE *json = argc > 2 ? fopen(argv[2], "w") : NULL;
    if (json)
        fprintf(json, "{\"seconds\": %g, \"edges_s\": [", seconds);
    for (int b = 0; json && b < BINS; b++)
        fprintf(json, "%s%g", b ? ", " : "", EDGES[b]);
    if (json)
        fprintf(json, "], \"cores\": [");
    for (long i = 0; i < n; i++) {
        double all = 0, long_lost = 0;
        long long_gaps = 0;
        for (int b = 0; b < BINS; b++) {
            all += cores[i].lost[b];
            if (EDGES[b] >= 1e-3) {
                long_gaps += cores[i].gaps[b];
                long_lost += cores[i].lost[b];
            }
        }
        printf("core %ld: %.2f%% lost; gaps of 1 ms or more: %.2f a second, %.2f ms on "
               "average\n", i, 100 * all / seconds, long_gaps / seconds,
               long_gaps ? 1e3 * long_lost / long_gaps : 0.0);
        for (int b = 0; b < BINS; b++)
            printf("  %6.0f us and up: %6ld gaps, %8.2f ms\n", EDGES[b] * 1e6,
                   cores[i].gaps[b], cores[i].lost[b] * 1e3);
        if (json) {
            fprintf(json, "%s{\"core\": %ld, \"lost_share\": %.6f, \"gaps\": [", i ? ", " : "",
                    i, all / seconds);
            for (int b = 0; b < BINS; b++)
                fprintf(json, "%s%ld", b ? ", " : "", cores[i].gaps[b]);
            fprintf(json, "], \"lost_s\": [");
            for (int b = 0; b < BINS; b++)
                fprintf(json, "%s%.6f", b ? ", " : "", cores[i].lost[b]);
            fprintf(json, "]}");
        }
    }
    if (json) {
        fprintf(json, "]}\n");
        fclose(json);
    }
    free(cores);
    free(threads);
    return 0;
}
