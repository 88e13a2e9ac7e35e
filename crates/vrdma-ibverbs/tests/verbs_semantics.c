/* Compiled by tests/binaries.rs against Debian's <infiniband/verbs.h> and run over the
 * drop-in: what a C application observes, through the header's inline functions too.
 * One context of the vNIC at $SOCK_A, a QP connected to another of the same vNIC; prints "ALL OK". */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <infiniband/verbs.h>

#define CHECK(c) do { if (!(c)) { fprintf(stderr, "FAILED line %d: %s (errno %d)\n", __LINE__, #c, errno); exit(1); } } while (0)

static struct ibv_context *open_vnic(const char *sock_env)
{
	int n = -1;
	setenv("VRDMA_SOCKET", getenv(sock_env), 1);
	/* The device list is per process: the first vNIC found is the one of this process. */
	struct ibv_device **list = ibv_get_device_list(&n);
	CHECK(list && n == 1 && list[1] == NULL);
	CHECK(strncmp(ibv_get_device_name(list[0]), "vrdma_", 6) == 0);
	struct ibv_context *ctx = ibv_open_device(list[0]);
	CHECK(ctx);
	ibv_free_device_list(list);
	return ctx;
}

static void to_rts(struct ibv_qp *qp, union ibv_gid *dgid, uint32_t dqpn)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1,
				 .qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC };
	CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) == 0);
	CHECK(qp->state == IBV_QPS_INIT);
	memset(&a, 0, sizeof a);
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = IBV_MTU_4096;
	a.dest_qp_num = dqpn;
	a.max_dest_rd_atomic = 1;
	a.min_rnr_timer = 12;
	a.ah_attr.is_global = 1;
	a.ah_attr.grh.dgid = *dgid;
	a.ah_attr.grh.hop_limit = 1;
	a.ah_attr.port_num = 1;
	CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
				     IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) == 0);
	memset(&a, 0, sizeof a);
	a.qp_state = IBV_QPS_RTS;
	a.timeout = 14;
	a.retry_cnt = 7;
	a.rnr_retry = 7;
	a.max_rd_atomic = 1;
	CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
				     IBV_QP_MAX_QP_RD_ATOMIC) == 0);
}

static struct ibv_wc wait_wc(struct ibv_cq *cq)
{
	struct ibv_wc wc;
	int n;
	for (long i = 0; i < 100000000L; i++) {
		n = ibv_poll_cq(cq, 1, &wc);
		CHECK(n >= 0);
		if (n == 1)
			return wc;
	}
	CHECK(!"completion timed out");
	return wc;
}

/* A thread building batches of two RDMA WRITEs of the same value on one QP shared with
 * another such thread: ibv_wr_start .. ibv_wr_complete is a per-QP critical section, so
 * the two never mix their WRs, and each batch's data is in place when it returns. */
struct builder {
	struct ibv_qp_ex *qpx;
	uint32_t rkey;
	volatile uint64_t *dst;
	uint64_t id;
};

static void *build_batches(void *arg)
{
	struct builder *b = arg;
	for (uint64_t i = 0; i < 20000; i++) {
		uint64_t v = b->id << 32 | i;
		ibv_wr_start(b->qpx);
		b->qpx->wr_id = v;
		b->qpx->wr_flags = 0;
		ibv_wr_rdma_write(b->qpx, b->rkey, (uintptr_t)b->dst);
		ibv_wr_set_inline_data(b->qpx, &v, 8);
		ibv_wr_rdma_write(b->qpx, b->rkey, (uintptr_t)(b->dst + 1));
		ibv_wr_set_inline_data(b->qpx, &v, 8);
		if (ibv_wr_complete(b->qpx) || b->dst[0] != v || b->dst[1] != v)
			return (void *)1;
	}
	return NULL;
}

int main(void)
{
	struct ibv_context *ca = open_vnic("SOCK_A");

	/* Queries, through the header's inline functions. */
	struct ibv_device_attr_ex dx;
	CHECK(ibv_query_device_ex(ca, NULL, &dx) == 0 && dx.orig_attr.phys_port_cnt == 1);
	struct ibv_port_attr pa;
	CHECK(ibv_query_port(ca, 1, &pa) == 0);
	CHECK(pa.state == IBV_PORT_ACTIVE && pa.link_layer == IBV_LINK_LAYER_ETHERNET && pa.active_mtu == IBV_MTU_4096);
	CHECK(ibv_query_port(ca, 2, &pa) == EINVAL);
	union ibv_gid ga;
	CHECK(ibv_query_gid(ca, 1, 0, &ga) == 0 && ga.raw[10] == 0xff && ga.raw[11] == 0xff);
	CHECK(ibv_query_gid(ca, 1, 5, &ga) == -1);
	struct ibv_gid_entry ge;
	CHECK(ibv_query_gid_ex(ca, 1, 0, &ge, 0) == 0 && ge.gid_type == IBV_GID_TYPE_ROCE_V2);
	uint16_t pkey;
	CHECK(ibv_query_pkey(ca, 1, 0, &pkey) == 0 && pkey == 0xffff);

	/* Objects, and what is refused. */
	struct ibv_pd *pd = ibv_alloc_pd(ca);
	CHECK(pd);
	struct ibv_comp_channel *ch = ibv_create_comp_channel(ca);
	CHECK(ch && ch->fd >= 0);
	struct ibv_cq *cq = ibv_create_cq(ca, 64, (void *)0x1234, ch, 0);
	CHECK(cq && cq->cq_context == (void *)0x1234);
	CHECK(ibv_destroy_comp_channel(ch) == EBUSY);
	struct ibv_cq_init_attr_ex cqx = { .cqe = 16 };
	errno = 0;
	CHECK(ibv_create_cq_ex(ca, &cqx) == NULL && errno == EOPNOTSUPP);
	errno = 0;
	CHECK(ibv_alloc_mw(pd, IBV_MW_TYPE_1) == NULL && errno == EOPNOTSUPP);
	struct ibv_qp_init_attr uc = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_UC, .cap = { 1, 1, 1, 1, 0 } };
	errno = 0;
	CHECK(ibv_create_qp(pd, &uc) == NULL && errno == EOPNOTSUPP);
	char *buf = calloc(1, 1 << 20);
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, 1 << 20, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
					   IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC | IBV_ACCESS_RELAXED_ORDERING);
	CHECK(mr && mr->addr == buf && mr->length == 1 << 20 && mr->pd == pd);
	CHECK(ibv_dealloc_pd(pd) == EBUSY);
	struct ibv_qp_init_attr_ex qx = {
		.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC, .cap = { 64, 64, 2, 2, 64 },
		.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS, .pd = pd,
		.send_ops_flags = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD,
	};
	struct ibv_qp *qa = ibv_create_qp_ex(ca, &qx);
	CHECK(qa && qa->qp_num && qa->state == IBV_QPS_RESET && qx.cap.max_inline_data >= 64);
	struct ibv_qp_attr bad = { .qp_state = IBV_QPS_RTS };
	CHECK(ibv_modify_qp(qa, &bad, IBV_QP_STATE) == EINVAL); /* RESET -> RTS */

	/* The peer QP: same vNIC (a process sees one device), its own PD and CQ. */
	struct ibv_context *cb = ca;
	struct ibv_pd *pdb = ibv_alloc_pd(cb);
	struct ibv_cq *cqb = ibv_create_cq(cb, 64, NULL, NULL, 0);
	struct ibv_qp_init_attr ib = { .send_cq = cqb, .recv_cq = cqb, .qp_type = IBV_QPT_RC, .cap = { 64, 64, 2, 2, 64 } };
	struct ibv_qp *qb = ibv_create_qp(pdb, &ib);
	CHECK(pdb && cqb && qb);
	char *bufb = calloc(1, 1 << 20);
	struct ibv_mr *mrb = ibv_reg_mr(pdb, bufb, 1 << 20, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
					    IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC);
	CHECK(mrb);
	to_rts(qa, &ga, qb->qp_num);
	to_rts(qb, &ga, qa->qp_num);

	/* ibv_post_send / ibv_post_recv (ops table), SEND with immediate and two SGEs. */
	struct ibv_sge rs = { (uintptr_t)bufb, 4096, mrb->lkey };
	struct ibv_recv_wr rwr = { .wr_id = 77, .sg_list = &rs, .num_sge = 1 }, *bad_r;
	CHECK(ibv_post_recv(qb, &rwr, &bad_r) == 0);
	strcpy(buf, "hello ");
	strcpy(buf + 100, "world");
	struct ibv_sge ss[2] = { { (uintptr_t)buf, 6, mr->lkey }, { (uintptr_t)buf + 100, 6, mr->lkey } };
	struct ibv_send_wr swr = { .wr_id = 5, .sg_list = ss, .num_sge = 2, .opcode = IBV_WR_SEND_WITH_IMM,
				   .send_flags = IBV_SEND_SIGNALED, .imm_data = htonl(0xabcd) }, *bad_s;
	CHECK(ibv_post_send(qa, &swr, &bad_s) == 0);
	struct ibv_wc wc = wait_wc(cq);
	CHECK(wc.wr_id == 5 && wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_SEND && wc.qp_num == qa->qp_num);
	wc = wait_wc(cqb);
	CHECK(wc.wr_id == 77 && wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RECV && wc.byte_len == 12);
	CHECK((wc.wc_flags & IBV_WC_WITH_IMM) && ntohl(wc.imm_data) == 0xabcd && wc.src_qp == qa->qp_num);
	CHECK(strcmp(bufb, "hello world") == 0);

	/* The ibv_wr_* API: an RDMA WRITE of inline data and a FETCH_AND_ADD in one batch. */
	struct ibv_qp_ex *qpx = ibv_qp_to_qp_ex(qa);
	CHECK(qpx);
	*(uint64_t *)(bufb + 8192) = 40;
	ibv_wr_start(qpx);
	qpx->wr_id = 6;
	qpx->wr_flags = 0;
	ibv_wr_rdma_write(qpx, mrb->rkey, (uintptr_t)bufb + 4096);
	ibv_wr_set_inline_data(qpx, "inline!", 8);
	qpx->wr_id = 7;
	qpx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_atomic_fetch_add(qpx, mrb->rkey, (uintptr_t)bufb + 8192, 2);
	ibv_wr_set_sge(qpx, mr->lkey, (uintptr_t)buf + 512, 8);
	CHECK(ibv_wr_complete(qpx) == 0);
	wc = wait_wc(cq);
	CHECK(wc.wr_id == 7 && wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_FETCH_ADD);
	CHECK(*(uint64_t *)(buf + 512) == 40 && *(uint64_t *)(bufb + 8192) == 42 && strcmp(bufb + 4096, "inline!") == 0);
	/* Unsupported WR-API operations fail the batch instead of crashing. */
	ibv_wr_start(qpx);
	ibv_wr_local_inv(qpx, 1);
	CHECK(ibv_wr_complete(qpx) == EOPNOTSUPP);

	/* The one-WR forms (what latency loops post): a WR-API SEND of one SGE, an
	 * ibv_post_send RDMA WRITE of one SGE, and a WR-API batch longer than the reserved one. */
	CHECK(ibv_post_recv(qb, &rwr, &bad_r) == 0);
	strcpy(buf + 1024, "one sge");
	ibv_wr_start(qpx);
	qpx->wr_id = 10;
	qpx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_send(qpx);
	ibv_wr_set_sge(qpx, mr->lkey, (uintptr_t)buf + 1024, 8);
	CHECK(ibv_wr_complete(qpx) == 0);
	wc = wait_wc(cq);
	CHECK(wc.wr_id == 10 && wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_SEND);
	wc = wait_wc(cqb);
	CHECK(wc.wr_id == 77 && wc.status == IBV_WC_SUCCESS && wc.byte_len == 8 && strcmp(bufb, "one sge") == 0);
	strcpy(buf + 2048, "written");
	struct ibv_sge s1 = { (uintptr_t)buf + 2048, 8, mr->lkey };
	struct ibv_send_wr w1 = { .wr_id = 11, .sg_list = &s1, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
				  .send_flags = IBV_SEND_SIGNALED, .wr.rdma = { (uintptr_t)bufb + 12288, mrb->rkey } };
	CHECK(ibv_post_send(qa, &w1, &bad_s) == 0);
	wc = wait_wc(cq);
	CHECK(wc.wr_id == 11 && wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RDMA_WRITE);
	CHECK(strcmp(bufb + 12288, "written") == 0);
	ibv_wr_start(qpx);
	for (int i = 0; i < 40; i++) {
		char b[12];
		snprintf(b, sizeof b, "w%02d", i);
		qpx->wr_id = 100 + i;
		qpx->wr_flags = i == 39 ? IBV_SEND_SIGNALED : 0;
		ibv_wr_rdma_write(qpx, mrb->rkey, (uintptr_t)bufb + 16384 + 16 * i);
		ibv_wr_set_inline_data(qpx, b, i % 2 ? 4 : 12); /* both copy paths */
	}
	CHECK(ibv_wr_complete(qpx) == 0);
	wc = wait_wc(cq);
	CHECK(wc.wr_id == 139 && wc.status == IBV_WC_SUCCESS);
	for (int i = 0; i < 40; i++) {
		char b[12];
		snprintf(b, sizeof b, "w%02d", i);
		CHECK(memcmp(bufb + 16384 + 16 * i, b, 4) == 0);
	}

	/* The other ways of giving a WR its data, alone and in one batch: a gather list, an
	 * inline list (copied into the batch's buffer), the largest inline kept beside the WR,
	 * and a single SGE after them. */
	strcpy(buf + 3072, "abcd");
	strcpy(buf + 3080, "efgh");
	struct ibv_sge sl[2] = { { (uintptr_t)buf + 3072, 4, mr->lkey }, { (uintptr_t)buf + 3080, 5, mr->lkey } };
	struct ibv_data_buf dl[2] = { { "ijk", 3 }, { "lmnop", 6 } };
	ibv_wr_start(qpx);
	qpx->wr_id = 20;
	qpx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_rdma_write(qpx, mrb->rkey, (uintptr_t)bufb + 20480);
	ibv_wr_set_sge_list(qpx, 2, sl);
	CHECK(ibv_wr_complete(qpx) == 0);
	wc = wait_wc(cq);
	CHECK(wc.wr_id == 20 && wc.status == IBV_WC_SUCCESS && strcmp(bufb + 20480, "abcdefgh") == 0);
	ibv_wr_start(qpx);
	qpx->wr_id = 21;
	ibv_wr_rdma_write(qpx, mrb->rkey, (uintptr_t)bufb + 20544);
	ibv_wr_set_inline_data_list(qpx, 2, dl);
	CHECK(ibv_wr_complete(qpx) == 0);
	wc = wait_wc(cq);
	CHECK(wc.wr_id == 21 && wc.status == IBV_WC_SUCCESS && strcmp(bufb + 20544, "ijklmnop") == 0);
	char big[64];
	memset(big, 'x', 63);
	big[63] = 0;
	ibv_wr_start(qpx);
	qpx->wr_id = 22;
	qpx->wr_flags = 0;
	ibv_wr_rdma_write(qpx, mrb->rkey, (uintptr_t)bufb + 20608);
	ibv_wr_set_sge_list(qpx, 2, sl);
	qpx->wr_id = 23;
	ibv_wr_rdma_write(qpx, mrb->rkey, (uintptr_t)bufb + 20672);
	ibv_wr_set_inline_data_list(qpx, 2, dl);
	qpx->wr_id = 24;
	ibv_wr_rdma_write(qpx, mrb->rkey, (uintptr_t)bufb + 20736);
	ibv_wr_set_inline_data(qpx, big, 64);
	qpx->wr_id = 25;
	qpx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_rdma_write(qpx, mrb->rkey, (uintptr_t)bufb + 20864);
	ibv_wr_set_sge(qpx, mr->lkey, (uintptr_t)buf + 3072, 4);
	CHECK(ibv_wr_complete(qpx) == 0);
	wc = wait_wc(cq);
	CHECK(wc.wr_id == 25 && wc.status == IBV_WC_SUCCESS);
	CHECK(strcmp(bufb + 20608, "abcdefgh") == 0 && strcmp(bufb + 20672, "ijklmnop") == 0);
	CHECK(strcmp(bufb + 20736, big) == 0 && memcmp(bufb + 20864, "abcd", 4) == 0);
	/* An aborted batch posts nothing. */
	ibv_wr_start(qpx);
	qpx->wr_id = 26;
	ibv_wr_rdma_write(qpx, mrb->rkey, (uintptr_t)bufb + 20928);
	ibv_wr_set_inline_data(qpx, "aborted", 8);
	ibv_wr_abort(qpx);
	ibv_wr_start(qpx);
	CHECK(ibv_wr_complete(qpx) == 0);
	CHECK(bufb[20928] == 0 && ibv_poll_cq(cq, 1, &wc) == 0);

	/* A batch is posted entirely or not at all: a WR the QP cannot take (more inline
	 * bytes than max_inline_data) fails ibv_wr_complete, and the WR before it in the same
	 * batch is not posted either. */
	size_t too_big = qx.cap.max_inline_data + 1;
	char *tb = calloc(1, too_big);
	ibv_wr_start(qpx);
	qpx->wr_id = 27;
	qpx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_rdma_write(qpx, mrb->rkey, (uintptr_t)bufb + 20992);
	ibv_wr_set_inline_data(qpx, "unposted", 9);
	ibv_wr_rdma_write(qpx, mrb->rkey, (uintptr_t)bufb + 24576);
	ibv_wr_set_inline_data(qpx, tb, too_big);
	CHECK(ibv_wr_complete(qpx) == EINVAL);
	CHECK(bufb[20992] == 0 && bufb[24576] == 0 && ibv_poll_cq(cq, 1, &wc) == 0);
	free(tb);
	/* Two threads building batches on one QP take turns. */
	struct builder bld[2] = { { qpx, mrb->rkey, (uint64_t *)(bufb + 28672), 1 },
				  { qpx, mrb->rkey, (uint64_t *)(bufb + 28736), 2 } };
	pthread_t th[2];
	void *res[2];
	for (int i = 0; i < 2; i++)
		CHECK(pthread_create(&th[i], NULL, build_batches, &bld[i]) == 0);
	for (int i = 0; i < 2; i++)
		CHECK(pthread_join(th[i], &res[i]) == 0 && res[i] == NULL);
	CHECK(ibv_poll_cq(cq, 1, &wc) == 0);

	/* UD through the WR API: the destination comes from ibv_wr_set_ud_addr. */
	struct ibv_qp_init_attr iu = { .send_cq = cqb, .recv_cq = cqb, .qp_type = IBV_QPT_UD, .cap = { 8, 8, 1, 1, 64 } };
	struct ibv_qp *ua = ibv_create_qp(pdb, &iu), *ub = ibv_create_qp(pdb, &iu);
	CHECK(ua && ub);
	struct ibv_qp *uds[2] = { ua, ub };
	for (int i = 0; i < 2; i++) {
		struct ibv_qp_attr u = { .qp_state = IBV_QPS_INIT, .port_num = 1, .qkey = 0x1111 };
		CHECK(ibv_modify_qp(uds[i], &u, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY) == 0);
		u.qp_state = IBV_QPS_RTR;
		CHECK(ibv_modify_qp(uds[i], &u, IBV_QP_STATE) == 0);
		u.qp_state = IBV_QPS_RTS;
		CHECK(ibv_modify_qp(uds[i], &u, IBV_QP_STATE | IBV_QP_SQ_PSN) == 0);
	}
	struct ibv_ah_attr aha = { .is_global = 1, .grh = { .dgid = ga, .hop_limit = 1 }, .port_num = 1 };
	struct ibv_ah *ah = ibv_create_ah(pdb, &aha);
	CHECK(ah);
	struct ibv_sge us = { (uintptr_t)bufb + 65536, 4096, mrb->lkey };
	struct ibv_recv_wr urwr = { .wr_id = 78, .sg_list = &us, .num_sge = 1 };
	CHECK(ibv_post_recv(ub, &urwr, &bad_r) == 0);
	struct ibv_qp_ex *uqx = ibv_qp_to_qp_ex(ua);
	ibv_wr_start(uqx);
	uqx->wr_id = 12;
	uqx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_send(uqx);
	ibv_wr_set_ud_addr(uqx, ah, ub->qp_num, 0x1111);
	ibv_wr_set_inline_data(uqx, "datagram", 9);
	CHECK(ibv_wr_complete(uqx) == 0);
	wc = wait_wc(cqb);
	CHECK(wc.wr_id == 12 && wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_SEND);
	wc = wait_wc(cqb);
	CHECK(wc.wr_id == 78 && wc.status == IBV_WC_SUCCESS && wc.byte_len == 40 + 9 && (wc.wc_flags & IBV_WC_GRH));
	CHECK(wc.src_qp == ua->qp_num && strcmp(bufb + 65536 + 40, "datagram") == 0);
	CHECK(ibv_destroy_ah(ah) == 0 && ibv_destroy_qp(ua) == 0 && ibv_destroy_qp(ub) == 0);

	/* A bad rkey completes with REM_ACCESS_ERR and the QP goes to ERR. */
	struct ibv_send_wr w2 = { .wr_id = 8, .sg_list = ss, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
				  .send_flags = IBV_SEND_SIGNALED, .wr.rdma = { (uintptr_t)bufb, mrb->rkey ^ 0x100 } };
	CHECK(ibv_post_send(qa, &w2, &bad_s) == 0);
	wc = wait_wc(cq);
	CHECK(wc.wr_id == 8 && wc.status == IBV_WC_REM_ACCESS_ERR);
	struct ibv_qp_attr qattr;
	struct ibv_qp_init_attr qinit;
	CHECK(ibv_query_qp(qa, &qattr, IBV_QP_STATE, &qinit) == 0 && qattr.qp_state == IBV_QPS_ERR);
	CHECK(strcmp(ibv_wc_status_str(IBV_WC_REM_ACCESS_ERR), "remote access error") == 0);

	/* Asynchronous events: a QP attached to an SRQ that enters ERR reports
	 * IBV_EVENT_QP_LAST_WQE_REACHED on async_fd (UCX waits for it before destroying
	 * such a QP); other QPs in ERR (qa, above) report nothing. */
	CHECK(fcntl(ca->async_fd, F_SETFL, fcntl(ca->async_fd, F_GETFL) | O_NONBLOCK) == 0);
	struct ibv_async_event ev;
	errno = 0;
	CHECK(ibv_get_async_event(ca, &ev) == -1 && errno == EAGAIN);
	struct ibv_srq_init_attr si = { .attr = { .max_wr = 16, .max_sge = 1 } };
	struct ibv_srq *srq = ibv_create_srq(pd, &si);
	CHECK(srq);
	struct ibv_qp *qs[2];
	for (int i = 0; i < 2; i++) {
		struct ibv_qp_init_attr sqa = { .send_cq = cq, .recv_cq = cq, .srq = srq, .qp_type = IBV_QPT_RC,
						.cap = { 4, 0, 1, 0, 0 } };
		qs[i] = ibv_create_qp(pd, &sqa);
		CHECK(qs[i]);
		struct ibv_qp_attr ia = { .qp_state = IBV_QPS_INIT, .port_num = 1 };
		CHECK(ibv_modify_qp(qs[i], &ia, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) == 0);
	}
	struct pollfd pfd = { .fd = ca->async_fd, .events = POLLIN };
	CHECK(poll(&pfd, 1, 0) == 0);
	struct ibv_qp_attr toerr = { .qp_state = IBV_QPS_ERR };
	CHECK(ibv_modify_qp(qs[0], &toerr, IBV_QP_STATE) == 0);
	CHECK(poll(&pfd, 1, 1000) == 1);
	CHECK(ibv_get_async_event(ca, &ev) == 0 && ev.event_type == IBV_EVENT_QP_LAST_WQE_REACHED && ev.element.qp == qs[0]);
	ibv_ack_async_event(&ev);
	errno = 0;
	CHECK(ibv_get_async_event(ca, &ev) == -1 && errno == EAGAIN);
	/* An event not read when its QP is destroyed is never reported. */
	CHECK(ibv_modify_qp(qs[1], &toerr, IBV_QP_STATE) == 0);
	CHECK(ibv_destroy_srq(srq) == EBUSY);
	CHECK(ibv_destroy_qp(qs[0]) == 0 && ibv_destroy_qp(qs[1]) == 0);
	errno = 0;
	CHECK(ibv_get_async_event(ca, &ev) == -1 && errno == EAGAIN);
	CHECK(ibv_destroy_srq(srq) == 0);

	/* The SRQ limit (MVAPICH-style refill threads wait for it): armed by ibv_modify_srq,
	 * IBV_EVENT_SRQ_LIMIT_REACHED once fewer receives than the limit are outstanding, then
	 * disarmed. SRQs have a fixed size. */
	srq = ibv_create_srq(pd, &si);
	CHECK(srq);
	struct ibv_srq_attr sa = { .srq_limit = 3 };
	CHECK(ibv_modify_srq(srq, &sa, IBV_SRQ_LIMIT) == 0);
	struct ibv_srq_attr sq;
	CHECK(ibv_query_srq(srq, &sq) == 0 && sq.srq_limit == 3 && sq.max_wr == 16);
	sa.srq_limit = 17;
	CHECK(ibv_modify_srq(srq, &sa, IBV_SRQ_LIMIT) == EINVAL);
	sa.max_wr = 32;
	CHECK(ibv_modify_srq(srq, &sa, IBV_SRQ_MAX_WR) == EOPNOTSUPP);
	struct ibv_cq *cqs = ibv_create_cq(ca, 16, NULL, NULL, 0);
	struct ibv_qp_init_attr rqa = { .send_cq = cqs, .recv_cq = cqs, .srq = srq, .qp_type = IBV_QPT_RC, .cap = { 4, 0, 1, 0, 0 } };
	struct ibv_qp_init_attr sqa2 = { .send_cq = cqs, .recv_cq = cqs, .qp_type = IBV_QPT_RC, .cap = { 4, 4, 1, 1, 0 } };
	struct ibv_qp *qsr = ibv_create_qp(pd, &rqa), *qss = ibv_create_qp(pd, &sqa2);
	CHECK(cqs && qsr && qss);
	to_rts(qsr, &ga, qss->qp_num);
	to_rts(qss, &ga, qsr->qp_num);
	for (int i = 0; i < 4; i++) {
		struct ibv_sge ls = { (uintptr_t)buf + 4096 + i * 64, 64, mr->lkey };
		struct ibv_recv_wr lr = { .wr_id = 500 + i, .sg_list = &ls, .num_sge = 1 }, *bad_lr;
		CHECK(ibv_post_srq_recv(srq, &lr, &bad_lr) == 0);
	}
	for (int i = 0; i < 3; i++) {
		struct ibv_sge ss = { (uintptr_t)buf, 8, mr->lkey };
		struct ibv_send_wr sw = { .wr_id = 600 + i, .sg_list = &ss, .num_sge = 1, .opcode = IBV_WR_SEND }, *bad_sw;
		CHECK(ibv_post_send(qss, &sw, &bad_sw) == 0);
		struct ibv_wc wc = wait_wc(cqs);
		CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == 500 + (uint64_t)i && wc.qp_num == qsr->qp_num);
		/* 3 outstanding after the first: not below the limit; 2 after the second: below. */
		errno = 0;
		if (i == 0) {
			CHECK(ibv_get_async_event(ca, &ev) == -1 && errno == EAGAIN);
		} else if (i == 1) {
			CHECK(poll(&pfd, 1, 1000) == 1);
			CHECK(ibv_get_async_event(ca, &ev) == 0 && ev.event_type == IBV_EVENT_SRQ_LIMIT_REACHED &&
			      ev.element.srq == srq);
			CHECK(ibv_query_srq(srq, &sq) == 0 && sq.srq_limit == 0);
			ibv_ack_async_event(&ev);
		} else {
			/* Disarmed: no second event. */
			CHECK(ibv_get_async_event(ca, &ev) == -1 && errno == EAGAIN);
		}
	}
	CHECK(ibv_destroy_qp(qsr) == 0 && ibv_destroy_qp(qss) == 0);
	CHECK(ibv_destroy_srq(srq) == 0 && ibv_destroy_cq(cqs) == 0);

	/* Teardown in order; destroying a CQ in use is refused. */
	CHECK(ibv_destroy_cq(cq) == EBUSY);
	CHECK(ibv_destroy_qp(qa) == 0 && ibv_destroy_qp(qb) == 0);
	CHECK(ibv_dereg_mr(mr) == 0 && ibv_dereg_mr(mrb) == 0);
	CHECK(ibv_destroy_cq(cq) == 0 && ibv_destroy_cq(cqb) == 0);
	CHECK(ibv_destroy_comp_channel(ch) == 0);
	CHECK(ibv_dealloc_pd(pd) == 0 && ibv_dealloc_pd(pdb) == 0);
	CHECK(ibv_close_device(ca) == 0);
	printf("ALL OK\n");
	return 0;
}
