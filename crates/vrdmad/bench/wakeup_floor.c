/*
 * What a daemon-mediated one-way costs on this machine at the least, beside the direct TCP
 * path UCX takes: two "hosts" (network namespaces joined by a veth pair, set up by
 * scripts/bench-floor.sh), an 8-byte ping-pong between two busy-polling "applications" on
 * CPUs 0 and 1, and in between nothing but the wakeups and system calls of each design:
 *
 *   direct  the application sends on TCP itself; the peer application polls its socket
 *           (non-blocking recv in a loop: what UCX's TCP transport does);
 *   daemon  the application writes its word to shared memory and rings an eventfd; a
 *           "doorbell" thread (real-time priority, on the application's CPU) wakes, reads
 *           the eventfd and sends a 64-byte frame on TCP; the peer's "reader" thread (the
 *           same, on the CPU the data arrives on) wakes from recv and writes the word into
 *           the peer application's memory: vrdmad's two wakeups per one-way, with none of
 *           its work;
 *   remote  daemon, with each reader on its own application's CPU: the peer's send wakes it
 *           from the other CPU (an inter-processor interrupt), and it runs beside the
 *           sender's remaining work instead of after it;
 *   timed   daemon, with the reader waiting in ppoll with a TIMED_US timeout before each
 *           recv (a short high-resolution timer armed and cancelled per message).
 *
 * Usage: wakeup_floor MODE ITERATIONS [TIMED_US]; prints one line "MODE one-way X us".
 * No data checks beyond the ping-pong's own sequence numbers; not a test.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum { DIRECT, DAEMON, TIMED, REMOTE };
struct shared {
	volatile uint64_t word[2][8];     /* what each host's application posts */
	volatile uint64_t delivered[2][8]; /* what each host's reader delivered to it */
	volatile int ready[2][16];
	volatile double one_way_us;
};
static struct shared *S;
static int mode, timed_us, efd[2];
static long iters;
static const char *addr[2] = { "198.18.99.1", "198.18.99.2" };

static void die(const char *what) { perror(what); exit(1); }
static void on_cpu(int cpu) {
	cpu_set_t s;
	CPU_ZERO(&s);
	CPU_SET(cpu, &s);
	if (sched_setaffinity(0, sizeof s, &s)) die("sched_setaffinity");
}
static void realtime(void) {
	struct sched_param p = { .sched_priority = 10 };
	if (sched_setscheduler(0, SCHED_FIFO, &p)) die("SCHED_FIFO");
}
static void enter_netns(int host) {
	char path[64];
	snprintf(path, sizeof path, "/var/run/netns/vrdma-floor-%c", 'a' + host);
	int f = open(path, O_RDONLY);
	if (f < 0 || setns(f, CLONE_NEWNET)) die("setns");
	close(f);
}
static struct sockaddr_in sa(int host) {
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(5999) };
	inet_pton(AF_INET, addr[host], &a.sin_addr);
	return a;
}
static void nodelay(int s) { int one = 1; setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one); }
/* Host h's connection to the other host (it sends on it) and from it (it receives on it). */
static void connect_hosts(int h, int *out, int *in) {
	int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
	struct sockaddr_in me = sa(h), peer = sa(h ^ 1);
	setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
	if (bind(l, (void *)&me, sizeof me) || listen(l, 1)) die("listen");
	*out = socket(AF_INET, SOCK_STREAM, 0);
	if (h == 1) *in = accept(l, 0, 0);
	while (connect(*out, (void *)&peer, sizeof peer)) {
		usleep(10000);
		close(*out);
		*out = socket(AF_INET, SOCK_STREAM, 0);
	}
	if (h == 0) *in = accept(l, 0, 0);
	nodelay(*out);
	nodelay(*in);
	close(l);
}
static void recv_frame(int s, char *b) {
	for (size_t got = 0; got < 64;) {
		ssize_t n = recv(s, b + got, 64 - got, 0);
		if (n > 0) got += n;
		else if (n == 0) _exit(0);
		else if (errno != EAGAIN && errno != EINTR) die("recv");
	}
}
struct thread_arg { int host, sock; };
static void *doorbell(void *p) {
	struct thread_arg *a = p;
	on_cpu(a->host); /* the application's CPU: a local wakeup */
	realtime();
	char frame[64] = { 0 };
	for (;;) {
		uint64_t v;
		if (read(efd[a->host], &v, 8) != 8) die("eventfd read");
		v = S->word[a->host][0];
		memcpy(frame, &v, 8);
		if (send(a->sock, frame, 64, 0) != 64) die("send");
	}
	return NULL;
}
static void *reader(void *p) {
	struct thread_arg *a = p;
	/* Where the peer's doorbell thread sends from (a local wakeup), or, `remote`, on the
	 * receiving application's CPU (a wakeup from the other CPU). */
	on_cpu(mode == REMOTE ? a->host : a->host ^ 1);
	realtime();
	char frame[64];
	for (;;) {
		if (mode == TIMED) {
			struct pollfd pf = { .fd = a->sock, .events = POLLIN };
			struct timespec ts = { 0, timed_us * 1000L };
			ppoll(&pf, 1, &ts, 0);
		}
		recv_frame(a->sock, frame);
		uint64_t v;
		memcpy(&v, frame, 8);
		S->delivered[a->host][0] = v;
	}
	return NULL;
}
static double now_us(void) {
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}
static void post(int h, int out, uint64_t i) {
	if (mode == DIRECT) {
		char frame[64] = { 0 };
		memcpy(frame, &i, 8);
		if (send(out, frame, 64, 0) != 64) die("send");
		return;
	}
	S->word[h][0] = i;
	uint64_t one = 1;
	if (write(efd[h], &one, 8) != 8) die("eventfd write");
}
static void await(int h, int in, uint64_t i) {
	if (mode == DIRECT) {
		char frame[64];
		recv_frame(in, frame);
		return;
	}
	while (S->delivered[h][0] != i)
		;
}
static void host(int h) {
	enter_netns(h);
	int out = -1, in = -1;
	connect_hosts(h, &out, &in);
	pthread_t t;
	struct thread_arg *a = malloc(sizeof *a);
	a->host = h;
	a->sock = in;
	if (mode == DIRECT) fcntl(in, F_SETFL, fcntl(in, F_GETFL) | O_NONBLOCK);
	else if (pthread_create(&t, 0, reader, a)) die("pthread_create");
	struct thread_arg *d = malloc(sizeof *d);
	d->host = h;
	d->sock = out;
	if (mode != DIRECT && pthread_create(&t, 0, doorbell, d)) die("pthread_create");
	on_cpu(h);
	S->ready[h][0] = 1;
	while (!S->ready[h ^ 1][0])
		;
	usleep(100000);
	long warmup = iters / 10;
	double t0 = 0;
	for (long i = 1; i <= iters + warmup; i++) {
		if (i == warmup + 1) t0 = now_us();
		if (h == 0) {
			post(0, out, i);
			await(0, in, i);
		} else {
			await(1, in, i);
			post(1, out, i);
		}
	}
	if (h == 0) S->one_way_us = (now_us() - t0) / iters / 2;
	_exit(0);
}
int main(int argc, char **argv) {
	if (argc < 3) {
		fprintf(stderr, "usage: %s direct|daemon|remote|timed ITERATIONS [TIMED_US]\n", argv[0]);
		return 2;
	}
	mode = !strcmp(argv[1], "direct") ? DIRECT : !strcmp(argv[1], "daemon") ? DAEMON : !strcmp(argv[1], "remote") ? REMOTE : TIMED;
	iters = atol(argv[2]);
	timed_us = argc > 3 ? atoi(argv[3]) : 100;
	S = mmap(0, sizeof *S, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (S == MAP_FAILED) die("mmap");
	efd[0] = eventfd(0, 0);
	efd[1] = eventfd(0, 0);
	for (int h = 0; h < 2; h++)
		if (fork() == 0) host(h);
	int status, failed = 0;
	for (int h = 0; h < 2; h++) {
		wait(&status);
		failed |= !WIFEXITED(status) || WEXITSTATUS(status);
	}
	if (failed) return 1;
	printf("%s one-way %.2f us\n", argv[1], S->one_way_us);
	return 0;
}
