/* The flow table benchmark's sender (bench_flow_table.py): each second, one datagram per flow. Flows differ
   by destination port (up to `ports` of them) and by source socket beyond that, sent in sendmmsg
   batches: Python's sendto manages some 25k a second on a busy host, a full table needs 10 times that.
   Usage: flow_sender HOST FLOWS PORTS; prints "ready", then once stopped (SIGTERM) the datagrams it
   sent per second. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <time.h>

#define BATCH 1024
static volatile sig_atomic_t stop;
static void on_term(int sig) { (void)sig; stop = 1; }
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec / 1e9; }

int main(int argc, char **argv) {
    if (argc != 4)
        return 2;
    long flows = atol(argv[2]), ports = atol(argv[3]), sockets = (flows + ports - 1) / ports, sent = 0, rounds = 0;
    struct sockaddr_in *to = calloc(ports, sizeof *to);
    static struct mmsghdr msgs[BATCH];
    struct iovec iov = {"x", 1};
    int *fds = calloc(sockets, sizeof *fds);
    for (long s = 0; s < sockets; s++)
        fds[s] = socket(AF_INET, SOCK_DGRAM, 0);
    for (long p = 0; p < ports; p++) {
        to[p].sin_family = AF_INET;
        to[p].sin_port = htons(1024 + p);
        inet_pton(AF_INET, argv[1], &to[p].sin_addr);
    }
    signal(SIGTERM, on_term);
    puts("ready");
    fflush(stdout);
    double start = now();
    while (!stop) {
        for (long s = 0; s < sockets && !stop; s++) {
            long last = flows - s * ports < ports ? flows - s * ports : ports;
            for (long p = 0; p < last; p += BATCH) {
                int n = 0;
                for (; n < BATCH && p + n < last; n++)
                    msgs[n].msg_hdr = (struct msghdr){.msg_name = &to[p + n], .msg_namelen = sizeof *to,
                                                      .msg_iov = &iov, .msg_iovlen = 1};
                int done = sendmmsg(fds[s], msgs, n, 0);
                sent += done > 0 ? done : 0;
            }
        }
        rounds++;
        double wait = start + rounds - now();
        if (wait > 0 && !stop)
            nanosleep(&(struct timespec){(time_t)wait, (long)((wait - (time_t)wait) * 1e9)}, NULL);
    }
    printf("%.0f\n", sent / (now() - start));
    return 0;
}
