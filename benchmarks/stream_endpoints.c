/* The stream endpoints level's server (bench_flow_table.py): N listening ports in this process, each
   with one keep-alive connection from this process's client side that asks for a request a second
   (phases spread over the second); each answer is one SSE write (headers and an event), so each
   port is a stream endpoint of its own (sse) whose responses end at the next request: durations and
   TTFBs, never a gap or a stall. Usage: stream_endpoints N [EVERY]: with EVERY, every EVERY-th port
   answers 503 instead (a server shedding load); prints "ready" once every connection is open, runs
   until SIGTERM. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>

static const char REQUEST[] = "GET /events HTTP/1.1\r\nHost: bench\r\n\r\n";
static const char RESPONSE[] = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\ndata: token\n\n";
static const char UNAVAILABLE[] = "HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/event-stream\r\n\r\ndata: busy\n\n";

/* A listener on a port of its own, a client connected to it and the accepted side; 0 on success. */
static int open_endpoint(int *client, int *server) {
    struct sockaddr_in address = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t size = sizeof address;
    int listener = socket(AF_INET, SOCK_STREAM, 0);
    if (bind(listener, (struct sockaddr *)&address, size) < 0 || listen(listener, 1) < 0 ||
        getsockname(listener, (struct sockaddr *)&address, &size) < 0)
        return -1;
    *client = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(*client, (struct sockaddr *)&address, size) < 0)
        return -1;
    *server = accept(listener, NULL, NULL);
    return *server < 0 ? -1 : 0;
}

/* One request and its answer (`response`, of `size` bytes) on an endpoint's connection; 0 while both
   sides still talk. */
static int exchange(int client, int server, const char *response, size_t size) {
    char buffer[sizeof UNAVAILABLE];
    if (send(client, REQUEST, sizeof REQUEST - 1, 0) < 0 || recv(server, buffer, sizeof buffer, 0) <= 0 ||
        send(server, response, size, 0) < 0)
        return -1;
    return recv(client, buffer, sizeof buffer, 0) <= 0 ? -1 : 0;
}

int main(int argc, char **argv) {
    if (argc != 2 && argc != 3)
        return 2;
    long count = atol(argv[1]), every = argc == 3 ? atol(argv[2]) : 0;
    struct rlimit files;  /* three descriptors per endpoint: more than the usual soft limit of 1024 */
    getrlimit(RLIMIT_NOFILE, &files);
    files.rlim_cur = files.rlim_max;
    setrlimit(RLIMIT_NOFILE, &files);
    int *clients = calloc(count, sizeof *clients), *servers = calloc(count, sizeof *servers);
    for (long i = 0; i < count; i++)
        if (open_endpoint(&clients[i], &servers[i]) < 0)
            return 1;
    puts("ready");
    fflush(stdout);
    struct timespec pause = {0, 1000000000L / count};
    for (;;)
        for (long i = 0; i < count; i++) {
            int shed = every > 0 && i % every == every - 1;
            if (exchange(clients[i], servers[i], shed ? UNAVAILABLE : RESPONSE,
                         shed ? sizeof UNAVAILABLE - 1 : sizeof RESPONSE - 1) < 0)
                return 1;
            nanosleep(&pause, NULL);
        }
}
