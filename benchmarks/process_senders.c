/* The process levels' senders (bench_flow_table.py): N processes, each with a TCP connection over
   loopback to this one, sending one byte a second (phases spread over the second). This process
   accepts the connections and never reads (a byte a second fills no buffer); on SIGTERM it ends
   its process group: the senders and itself. Usage: process_senders N [NAMES]: with NAMES, the senders
   take that many names between them (sender-0, sender-1, ...), as a node's workloads share names;
   prints "ready" once every sender is connected. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static void send_each_second(struct sockaddr_in *sink, long phase_ns) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(fd, (struct sockaddr *)sink, sizeof *sink) < 0)
        _exit(1);
    nanosleep(&(struct timespec){0, phase_ns}, NULL);
    while (getppid() != 1 && send(fd, "x", 1, 0) == 1)
        sleep(1);
    _exit(0);
}

int main(int argc, char **argv) {
    if (argc != 2 && argc != 3)
        return 2;
    long count = atol(argv[1]), names = argc == 3 ? atol(argv[2]) : 0;
    struct sockaddr_in sink = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t size = sizeof sink;
    int listener = socket(AF_INET, SOCK_STREAM, 0);
    if (bind(listener, (struct sockaddr *)&sink, size) < 0 || listen(listener, 4096) < 0 ||
        getsockname(listener, (struct sockaddr *)&sink, &size) < 0)
        return 1;
    sigset_t term;
    sigemptyset(&term);
    sigaddset(&term, SIGTERM);
    sigprocmask(SIG_BLOCK, &term, NULL);
    setpgid(0, 0);  /* a group of its own: ended as one below */
    struct rlimit files;  /* one descriptor per sender: more than the usual soft limit of 1024 */
    getrlimit(RLIMIT_NOFILE, &files);
    files.rlim_cur = files.rlim_max;
    setrlimit(RLIMIT_NOFILE, &files);
    for (long i = 0; i < count; i++) {
        pid_t pid = fork();
        if (pid == 0) {
            sigprocmask(SIG_UNBLOCK, &term, NULL);
            if (names > 0) {
                char name[32];  /* the kernel keeps the first 15 bytes */
                snprintf(name, sizeof name, "sender-%ld", i % names);
                prctl(PR_SET_NAME, name);
            }
            send_each_second(&sink, i * 1000000000L / count);
        }
        if (pid < 0 || accept(listener, NULL, NULL) < 0)
            return 1;
    }
    puts("ready");
    fflush(stdout);
    int sig;
    sigwait(&term, &sig);
    kill(0, SIGKILL);  /* the senders and this process */
    return 0;
}
