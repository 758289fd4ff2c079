/* The sampling loop of jbench's sysfs telemetry source, compiled on the device (cc -O2).
 *
 * The Python reader (jbench/device/telemetry/hwmon.py, HWMON_READER) finds the files and prints the header;
 * then it execs this loop with them, so the 100 Hz loop costs no interpreter time. Output is the reader's own
 * line format, one line per sample, written in batches:
 *     <device epoch seconds> <fast values...> [| <slow values...>]
 * A value is the attribute's text (whitespace trimmed), or "-" when its read failed.
 *
 * usage: hwmon_loop INTERVAL_MS SLOW_MS N_FAST FAST_PATH... N_SLOW SLOW_PATH...
 * Exit 0 when the controller closes the stream, 2 for bad arguments. A file that cannot be opened reads "-".
 *
 * Each attribute stays open and is re-read with pread at offset 0: sysfs regenerates an attribute's text on a
 * read at offset 0 (Linux Documentation/filesystems/sysfs.rst), so no open/close per sample.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define OUT_CAP (64 * 1024)

static char out[OUT_CAP];
static size_t out_len;

static int flush_out(void) {
    size_t done = 0;
    while (done < out_len) {
        ssize_t n = write(1, out + done, out_len - done);
        if (n < 0) {
            if (errno == EINTR) continue;
            return -1; /* EPIPE: the controller closed the stream */
        }
        done += (size_t)n;
    }
    out_len = 0;
    return 0;
}

static void put(const char *s, size_t n) {
    if (out_len + n >= OUT_CAP) flush_out();
    memcpy(out + out_len, s, n);
    out_len += n;
}

static void put_value(int fd) {
    char buf[64];
    ssize_t n = fd < 0 ? -1 : pread(fd, buf, sizeof buf - 1, 0);
    size_t a = 0, b = n > 0 ? (size_t)n : 0;
    while (a < b && (buf[a] == ' ' || buf[a] == '\n' || buf[a] == '\t')) a++;
    while (b > a && (buf[b - 1] == ' ' || buf[b - 1] == '\n' || buf[b - 1] == '\t')) b--;
    put(" ", 1);
    if (b > a) put(buf + a, b - a);
    else put("-", 1);
}

static double mono(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    if (argc < 4) return 2;
    double interval = atof(argv[1]) / 1000.0, slow_every = atof(argv[2]) / 1000.0;
    int n_fast = atoi(argv[3]);
    if (interval <= 0 || n_fast < 0 || 4 + n_fast >= argc) return 2;
    int n_slow = atoi(argv[4 + n_fast]);
    if (n_slow < 0 || 5 + n_fast + n_slow != argc) return 2;
    int *fast = calloc((size_t)n_fast + 1, sizeof(int)), *slow = calloc((size_t)n_slow + 1, sizeof(int));
    for (int i = 0; i < n_fast; i++) fast[i] = open(argv[4 + i], O_RDONLY | O_CLOEXEC);
    for (int i = 0; i < n_slow; i++) slow[i] = open(argv[5 + n_fast + i], O_RDONLY | O_CLOEXEC);
    signal(SIGPIPE, SIG_IGN);

    struct timespec next;
    clock_gettime(CLOCK_MONOTONIC, &next);
    double next_slow = 0, last_flush = 0;
    int lines = 0;
    for (;;) {
        double now = mono();
        struct timespec wall;
        clock_gettime(CLOCK_REALTIME, &wall);
        char stamp[40];
        int k = snprintf(stamp, sizeof stamp, "%lld.%06ld", (long long)wall.tv_sec, wall.tv_nsec / 1000);
        put(stamp, (size_t)k);
        for (int i = 0; i < n_fast; i++) put_value(fast[i]);
        if (n_slow > 0 && now >= next_slow) {
            next_slow = now + slow_every;
            put(" |", 2);
            for (int i = 0; i < n_slow; i++) put_value(slow[i]);
        }
        put("\n", 1);
        lines++;
        /* Batches: one write per ~100 ms or 16 lines, and the first line at once so the start is seen. */
        if (lines >= 16 || now - last_flush >= 0.1 || last_flush == 0) {
            if (flush_out() < 0) return 0;
            lines = 0;
            last_flush = now;
        }
        long step = (long)(interval * 1e9);
        next.tv_nsec += step % 1000000000L;
        next.tv_sec += step / 1000000000L + next.tv_nsec / 1000000000L;
        next.tv_nsec %= 1000000000L;
        struct timespec cur;
        clock_gettime(CLOCK_MONOTONIC, &cur);
        double behind = (cur.tv_sec - next.tv_sec) + (cur.tv_nsec - next.tv_nsec) / 1e9;
        if (behind > interval) next = cur; /* fell behind (a suspended process): skip, never burst */
        else while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &next, NULL) == EINTR) {}
    }
}
