/*
 * The drop-in's own cost, measured without perftest's loop: `vrdma perf write_lat`'s exact
 * loop (perf.rs `latency`, Kind::Write) written in C against libibverbs, so that run through
 * the drop-in it differs from `vrdma perf` only by the C ABI layer. scripts/bench-dropin.sh
 * runs both between the same two containers and prints the ratio.
 *
 *   write_lat_loop [-w | -S] [-P] [-I INLINE] [-s SIZE] [-n ITERS] [-p PORT] [SERVER_IP]
 *
 * -w posts with the ibv_wr_* API (ibv_wr_start / ibv_wr_rdma_write / ibv_wr_set_inline_data
 * or ibv_wr_set_sge / ibv_wr_complete) instead of ibv_post_send. The client prints one JSON
 * line: {"test":"write_lat_loop","size":S,"iterations":N,"lat_p50_us":..,"lat_avg_us":..}.
 * -S runs `vrdma perf send_lat`'s loop instead (a signaled SEND, its completion, the peer's
 * SEND's receive completion, the receive reposted; the server answers each SEND), and
 * prints "send_lat_loop".
 * Like vrdma perf (and ib_write_lat): messages up to 64 bytes inline (-I sets the limit,
 * as vrdma perf's -I), every WR signaled and its completion polled, the latency is half the
 * ping-pong on memory, timed with the TSC that both sides read before each post. The wait
 * on memory also reads a flag that a thread sets when the peer hangs up (a dead peer writes
 * nothing more), as vrdma perf's does and as ib_write_lat's reads its run state; with PAUSE
 * between reads, or none with -P (vrdma perf --spin plain).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <infiniband/verbs.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <x86intrin.h>

struct info {
	uint32_t qpn;
	uint32_t rkey;
	uint64_t addr;
	uint8_t gid[16];
};

static void die(const char *what)
{
	fprintf(stderr, "write_lat_loop: %s: %s\n", what, strerror(errno));
	exit(1);
}

static int oob(const char *server, int port)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(port) };
	int one = 1, s = socket(AF_INET, SOCK_STREAM, 0);
	if (s < 0)
		die("socket");
	if (server) {
		inet_pton(AF_INET, server, &a.sin_addr);
		for (int i = 0; connect(s, (struct sockaddr *)&a, sizeof(a)) < 0; i++) {
			if (i > 100)
				die("connect");
			usleep(50000);
		}
	} else {
		setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
		if (bind(s, (struct sockaddr *)&a, sizeof(a)) < 0 || listen(s, 1) < 0)
			die("listen");
		int c = accept(s, NULL, NULL);
		if (c < 0)
			die("accept");
		close(s);
		s = c;
	}
	setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
	return s;
}

static void xfer(int s, const void *out, void *in, size_t n)
{
	if (write(s, out, n) != (ssize_t)n)
		die("oob write");
	size_t got = 0;
	while (got < n) {
		ssize_t r = read(s, (char *)in + got, n - got);
		if (r <= 0)
			die("oob read");
		got += r;
	}
}

/* Set by watch_hangup's thread when the peer's end of the out-of-band socket closes. */
static volatile int peer_gone;

static void *watch_hangup(void *arg)
{
	struct pollfd p = { .fd = *(int *)arg, .events = POLLRDHUP };
	while (poll(&p, 1, -1) < 0 && errno == EINTR)
		;
	peer_gone = 1;
	return NULL;
}

static void __attribute__((noreturn, cold)) gone(void)
{
	fprintf(stderr, "write_lat_loop: the peer closed the out-of-band connection while we waited for its write\n");
	exit(1);
}

/* Waits until the peer's write put `tag` at `at`; exits if the peer has gone. Two loops,
 * so that each is vrdma perf's (-P: a load of the byte, a load of the flag, no PAUSE). */
static inline void wait_for_tag(volatile uint8_t *at, uint8_t tag, int plain)
{
	if (plain) {
		while (*at != tag)
			if (peer_gone)
				gone();
	} else {
		while (*at != tag) {
			if (peer_gone)
				gone();
			__builtin_ia32_pause();
		}
	}
}

static int cmp(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

/* Waits for one successful completion on `cq`. */
static void poll1(struct ibv_cq *cq)
{
	struct ibv_wc wc;
	int n;
	while ((n = ibv_poll_cq(cq, 1, &wc)) == 0)
		;
	if (n < 0 || wc.status != IBV_WC_SUCCESS) {
		fprintf(stderr, "write_lat_loop: completion status %d\n", n < 0 ? -1 : (int)wc.status);
		exit(1);
	}
}

/* TSC ticks per microsecond, against CLOCK_MONOTONIC over 50 ms. */
static double tsc_per_us(void)
{
	struct timespec a, b;
	clock_gettime(CLOCK_MONOTONIC, &a);
	uint64_t t0 = __rdtsc();
	usleep(50000);
	clock_gettime(CLOCK_MONOTONIC, &b);
	uint64_t t1 = __rdtsc();
	double us = (b.tv_sec - a.tv_sec) * 1e6 + (b.tv_nsec - a.tv_nsec) / 1e3;
	return (t1 - t0) / us;
}

int main(int argc, char **argv)
{
	int size = 8, iters = 100000, port = 18555, wr_api = 0, send = 0, inline_max = 64, plain = 0, opt;
	while ((opt = getopt(argc, argv, "wSPI:s:n:p:")) != -1) {
		switch (opt) {
		case 'w': wr_api = 1; break;
		case 'S': send = 1; break;
		case 'P': plain = 1; break;
		case 'I': inline_max = atoi(optarg); break;
		case 's': size = atoi(optarg); break;
		case 'n': iters = atoi(optarg); break;
		case 'p': port = atoi(optarg); break;
		default: fprintf(stderr, "usage: %s [-w | -S] [-P] [-I inline] [-s size] [-n iters] [-p port] [server]\n", argv[0]); return 2;
		}
	}
	const char *server = optind < argc ? argv[optind] : NULL;
	int client = server != NULL;
	if (size < 1 || size > (1 << 20) || iters < 1 || (wr_api && send))
		return 2;
	/* vrdma perf's layout: a buffer of 2 * size rounded up to pages; the peer writes into
	 * its second half. */
	size_t stride = ((size_t)2 * size + 4095) / 4096 * 4096, half = stride / 2;

	struct ibv_device **devs = ibv_get_device_list(NULL);
	if (!devs || !devs[0])
		die("no device");
	struct ibv_context *ctx = ibv_open_device(devs[0]);
	if (!ctx)
		die("open device");
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	volatile uint8_t *buf = aligned_alloc(4096, stride);
	memset((void *)buf, 0, stride);
	struct ibv_mr *mr = ibv_reg_mr(pd, (void *)buf, stride,
				       IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
	struct ibv_cq *cq = ibv_create_cq(ctx, 128, NULL, NULL, 0);
	/* send_lat polls sends and receives apart, as vrdma perf does. */
	struct ibv_cq *rcq = send ? ibv_create_cq(ctx, 128, NULL, NULL, 0) : cq;
	if (!pd || !mr || !cq || !rcq)
		die("pd/mr/cq");
	struct ibv_qp_init_attr_ex ia = {
		.send_cq = cq, .recv_cq = rcq, .qp_type = IBV_QPT_RC, .pd = pd,
		.cap = { .max_send_wr = 128, .max_recv_wr = 16, .max_send_sge = 1, .max_recv_sge = 1, .max_inline_data = 64 },
		.comp_mask = IBV_QP_INIT_ATTR_PD | (wr_api ? IBV_QP_INIT_ATTR_SEND_OPS_FLAGS : 0),
		.send_ops_flags = IBV_QP_EX_WITH_RDMA_WRITE,
	};
	struct ibv_qp *qp = ibv_create_qp_ex(ctx, &ia);
	if (!qp)
		die("create_qp");
	struct ibv_qp_ex *qpx = wr_api ? ibv_qp_to_qp_ex(qp) : NULL;
	if (wr_api && !qpx)
		die("qp_to_qp_ex");
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1,
				 .qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ };
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
		die("INIT");
	union ibv_gid gid;
	if (ibv_query_gid(ctx, 1, 0, &gid))
		die("query_gid");
	struct info me = { .qpn = qp->qp_num, .rkey = mr->rkey, .addr = (uintptr_t)buf }, peer;
	memcpy(me.gid, gid.raw, 16);
	int s = oob(server, port);
	xfer(s, &me, &peer, sizeof(me));
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = IBV_MTU_4096;
	a.dest_qp_num = peer.qpn;
	a.max_dest_rd_atomic = 1;
	a.min_rnr_timer = 12;
	a.ah_attr.is_global = 1;
	a.ah_attr.port_num = 1;
	memcpy(a.ah_attr.grh.dgid.raw, peer.gid, 16);
	a.ah_attr.grh.hop_limit = 1;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
				      IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
		die("RTR");
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTS;
	a.timeout = 14;
	a.retry_cnt = 7;
	a.rnr_retry = 7;
	a.max_rd_atomic = 1;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
				      IBV_QP_MAX_QP_RD_ATOMIC))
		die("RTS");
	struct ibv_sge rsge = { .addr = (uintptr_t)buf + half, .length = half, .lkey = mr->lkey };
	struct ibv_recv_wr rwr = { .sg_list = &rsge, .num_sge = 1 }, *bad_rwr;
	for (int i = 0; send && i < 16; i++)
		if (ibv_post_recv(qp, &rwr, &bad_rwr))
			die("ibv_post_recv");
	char go = 1, back;
	xfer(s, &go, &back, 1);
	pthread_t watcher;
	if (pthread_create(&watcher, NULL, watch_hangup, &s))
		die("pthread_create");

	double per_us = client ? tsc_per_us() : 1;
	double *out = client ? malloc(sizeof(double) * iters) : NULL;
	unsigned inl = size <= inline_max ? IBV_SEND_INLINE : 0;
	struct ibv_sge sge = { .addr = (uintptr_t)buf, .length = size, .lkey = mr->lkey };
	struct ibv_send_wr wr = { .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
				  .wr.rdma = { .remote_addr = peer.addr + half, .rkey = peer.rkey } }, *bad;
	size_t last_local = half + size - 1;
	if (send) {
		struct ibv_send_wr swr = { .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND,
					   .send_flags = IBV_SEND_SIGNALED | inl };
		for (int i = 0; i < iters; i++) {
			uint64_t t0 = __rdtsc();
			if (client) {
				if (ibv_post_send(qp, &swr, &bad))
					die("ibv_post_send");
				poll1(cq);
				poll1(rcq);
				if (ibv_post_recv(qp, &rwr, &bad_rwr))
					die("ibv_post_recv");
				out[i] = (__rdtsc() - t0) / per_us / 2.0;
			} else {
				poll1(rcq);
				if (ibv_post_recv(qp, &rwr, &bad_rwr))
					die("ibv_post_recv");
				if (ibv_post_send(qp, &swr, &bad))
					die("ibv_post_send");
				poll1(cq);
			}
		}
	}
	/* Both sides read the TSC just before each post (vrdma perf's and ib_write_lat's
	 * stamps); an iteration's latency is half the time between two of the client's posts. */
	uint64_t *stamps = send ? NULL : malloc(sizeof(uint64_t) * ((size_t)iters + 1));
	if (!send && !stamps)
		die("malloc");
	for (int i = 0; !send && i < iters; i++) {
		uint8_t tag = i % 255 + 1;
		if (!client)
			wait_for_tag(buf + last_local, tag, plain);
		stamps[i] = __rdtsc();
		buf[size - 1] = tag;
		if (wr_api) {
			ibv_wr_start(qpx);
			qpx->wr_id = 0;
			qpx->wr_flags = IBV_SEND_SIGNALED | inl;
			ibv_wr_rdma_write(qpx, peer.rkey, peer.addr + half);
			if (inl)
				ibv_wr_set_inline_data(qpx, (void *)buf, size);
			else
				ibv_wr_set_sge(qpx, mr->lkey, (uintptr_t)buf, size);
			if (ibv_wr_complete(qpx))
				die("ibv_wr_complete");
		} else {
			wr.send_flags = IBV_SEND_SIGNALED | inl;
			if (ibv_post_send(qp, &wr, &bad))
				die("ibv_post_send");
		}
		poll1(cq);
		if (client)
			wait_for_tag(buf + last_local, tag, plain);
	}
	if (!send && client) {
		stamps[iters] = __rdtsc();
		for (int i = 0; i < iters; i++)
			out[i] = (stamps[i + 1] - stamps[i]) / per_us / 2.0;
	}
	free(stamps);
	xfer(s, &go, &back, 1);
	if (client) {
		double sum = 0;
		for (int i = 0; i < iters; i++)
			sum += out[i];
		qsort(out, iters, sizeof(double), cmp);
		printf("{\"test\":\"%s_lat_loop%s\",\"size\":%d,\"iterations\":%d,\"lat_p50_us\":%.4f,\"lat_avg_us\":%.4f}\n",
		       send ? "send" : "write", wr_api ? "_wr" : "", size, iters, out[iters / 2], sum / iters);
	}
	ibv_destroy_qp(qp);
	ibv_destroy_cq(cq);
	ibv_dereg_mr(mr);
	ibv_dealloc_pd(pd);
	ibv_close_device(ctx);
	ibv_free_device_list(devs);
	return 0;
}
