/*
 * copy_alignment: how fast this CPU copies with `rep movsb` (the kernel's copy between user
 * memory and socket buffers) by the distance between destination and source, and what that
 * does to a loopback request-reply loop shaped like NBD reads (bench/RESULTS.md, session 55;
 * ARCHITECTURE.md, "Data path").
 *
 *   cc -O2 -o /tmp/copy_alignment bench/copy_alignment.c
 *   /tmp/copy_alignment copy            # GB/s of 1 MiB copies over 256 MiB, by distance mod 64
 *   /tmp/copy_alignment reply H DEPTH   # 512 KiB replies behind an H-byte header, at DEPTH
 *
 * `reply`: a client keeps DEPTH 8-byte requests in flight; the server answers each with one
 * sendmsg of an H-byte header and 512 KiB from a page-aligned buffer; the client receives the
 * header, then the data into a buffer 16 bytes past a page (where glibc's malloc puts large
 * blocks, and so where fio's buffers lie). Prints GB/s and each side's CPU per MiB.
 */
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define CHUNK (1 << 19)
#define REPLIES 8000

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static double cpu_seconds(void) {
    struct rusage r;
    getrusage(RUSAGE_SELF, &r);
    return r.ru_utime.tv_sec + r.ru_stime.tv_sec + (r.ru_utime.tv_usec + r.ru_stime.tv_usec) / 1e6;
}

static void rep_movsb(void *dst, const void *src, size_t n) {
    __asm__ volatile("rep movsb" : "+D"(dst), "+S"(src), "+c"(n) : : "memory");
}

static int copy_rates(void) {
    size_t n = 1 << 20, region = (size_t)256 << 20;
    char *src = aligned_alloc(4096, region + 4096), *dst = aligned_alloc(4096, region + 4096);
    if (!src || !dst) return 1;
    memset(src, 1, region + 4096);
    memset(dst, 2, region + 4096);
    for (int distance = 0; distance < 64; distance += 4) {
        double start = seconds();
        for (size_t i = 0; i < 512; i++) {
            size_t at = (i * n) % region;
            rep_movsb(dst + at + distance, src + at, n);
        }
        printf("destination %2d bytes past the source: %.1f GB/s\n", distance,
               512.0 * n / (seconds() - start) / 1e9);
    }
    return 0;
}

static void receive_all(int fd, char *into, size_t n) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = recv(fd, into + got, n - got, 0);
        if (r <= 0) exit(2);
        got += r;
    }
}

static void send_all(int fd, struct iovec *iov, int count) {
    struct msghdr m = {.msg_iov = iov, .msg_iovlen = count};
    while (m.msg_iovlen) {
        ssize_t w = sendmsg(fd, &m, 0);
        if (w <= 0) exit(1);
        while (w > 0 && m.msg_iovlen) {
            if ((size_t)w >= m.msg_iov[0].iov_len) {
                w -= m.msg_iov[0].iov_len;
                m.msg_iov++;
                m.msg_iovlen--;
            } else {
                m.msg_iov[0].iov_base = (char *)m.msg_iov[0].iov_base + w;
                m.msg_iov[0].iov_len -= w;
                w = 0;
            }
        }
    }
}

static int request_reply(int header, int depth) {
    int listener = socket(AF_INET, SOCK_STREAM, 0), one = 1, results[2];
    struct sockaddr_in address = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(0x7f000001)};
    socklen_t length = sizeof address;
    if (bind(listener, (void *)&address, sizeof address) || listen(listener, 1) ||
        getsockname(listener, (void *)&address, &length) || pipe(results))
        return 1;
    pid_t server = fork();
    if (server == 0) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        if (connect(fd, (void *)&address, sizeof address)) exit(1);
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        char *data = aligned_alloc(4096, 16 * CHUNK), head[64], request[8];
        memset(data, 7, 16 * CHUNK);
        memset(head, 1, sizeof head);
        for (int i = 0; i < REPLIES; i++) {
            receive_all(fd, request, sizeof request);
            struct iovec iov[2] = {{head, header}, {data + (size_t)(i % 16) * CHUNK, CHUNK}};
            send_all(fd, header ? iov : iov + 1, header ? 2 : 1);
        }
        double used = cpu_seconds();
        if (write(results[1], &used, sizeof used) != sizeof used) exit(1);
        exit(0);
    }
    int fd = accept(listener, 0, 0);
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    char *buffer = aligned_alloc(4096, CHUNK + 8192), head[64], request[8] = {0};
    double start = seconds();
    int sent = 0;
    for (; sent < depth && sent < REPLIES; sent++) send(fd, request, sizeof request, 0);
    for (int i = 0; i < REPLIES; i++) {
        receive_all(fd, head, header);
        receive_all(fd, buffer + 16, CHUNK);
        if (sent < REPLIES) {
            send(fd, request, sizeof request, 0);
            sent++;
        }
    }
    double elapsed = seconds() - start, server_cpu;
    if (read(results[0], &server_cpu, sizeof server_cpu) != sizeof server_cpu) return 1;
    waitpid(server, 0, 0);
    double mib = REPLIES * (double)CHUNK / (1 << 20);
    printf("header %2d bytes, depth %d: %.2f GB/s, server %.0f µs of CPU per MiB, client %.0f\n",
           header, depth, REPLIES * (double)CHUNK / elapsed / 1e9, server_cpu * 1e6 / mib,
           cpu_seconds() * 1e6 / mib);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 2 && !strcmp(argv[1], "copy")) return copy_rates();
    if (argc == 4 && !strcmp(argv[1], "reply")) {
        int header = atoi(argv[2]), depth = atoi(argv[3]);
        if (header >= 0 && header <= 64 && depth > 0) return request_reply(header, depth);
    }
    fprintf(stderr, "usage: copy_alignment copy | copy_alignment reply HEADER(0-64) DEPTH\n");
    return 2;
}
