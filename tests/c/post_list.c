/* Chains of work requests given to one ibv_post_send / ibv_post_recv, as a program sees them.
 * Written against libibverbs only; tests/tests/ibverbs_rxe.rs builds it and runs it on vrdma0
 * through vrdma-run, then reads the backend's count of kicks.
 * usage: post_list DEVICE GID_INDEX CHAINS
 *   An RC QP connected to itself takes, CHAINS times: a chain of 16 receives, a chain of 16
 *   SENDs whose last is refused at posting (more SGEs than the QP takes: EINVAL, *bad_wr at
 *   it, the 15 before it posted) and one SEND alone; each after a 20 ms pause in which the
 *   device's poller falls asleep. So a device that takes a chain with one doorbell is rung
 *   3 x CHAINS times. Then a chain of WRITEs one longer than the send queue: the last is
 *   refused with ENOMEM, *bad_wr at it, the others posted. Every completion is checked.
 *   Prints "post_list: ok" on success; exits 1 on any failure. */
#include "checks.h"
#include <unistd.h>

#define CHAIN 16
#define MESSAGE 64

static struct ibv_cq *cq;

/* Waits up to 10 s for `count` completions, each successful with wr_id below `limit`. */
static void expect_completions(int count, uint64_t limit)
{
	for (int spins = 0; count > 0; spins++) {
		struct ibv_wc wc[CHAIN];
		int n = ibv_poll_cq(cq, CHAIN, wc);
		CHECK(n >= 0, "ibv_poll_cq");
		for (int i = 0; i < n; i++) {
			CHECK(wc[i].status == IBV_WC_SUCCESS, ibv_wc_status_str(wc[i].status));
			CHECK(wc[i].wr_id < limit, "a completion of a request that was posted");
		}
		count -= n;
		CHECK(spins < 10000000 || count == 0, "completions within the time limit");
		if (n == 0)
			usleep(1);
	}
}

int main(int argc, char **argv)
{
	CHECK(argc == 4, "usage: post_list DEVICE GID_INDEX CHAINS");
	int gid_index = atoi(argv[2]), chains = atoi(argv[3]);
	struct ibv_context *ctx = open_device_named(argv[1]);
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	CHECK(pd, "ibv_alloc_pd");
	cq = ibv_create_cq(ctx, 4 * CHAIN, NULL, NULL, 0);
	CHECK(cq, "ibv_create_cq");
	static uint8_t buf[2 * CHAIN * MESSAGE] __attribute__((aligned(4096)));
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, sizeof buf,
				       IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
	CHECK(mr, "ibv_reg_mr");
	struct ibv_qp_init_attr init = {
		.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC, .sq_sig_all = 1,
		.cap = { .max_send_wr = CHAIN, .max_recv_wr = CHAIN, .max_send_sge = 1,
			 .max_recv_sge = 1 },
	};
	struct ibv_qp *qp = ibv_create_qp(pd, &init);
	CHECK(qp, "ibv_create_qp");
	union ibv_gid gid;
	CHECK(!ibv_query_gid(ctx, 1, gid_index, &gid), "ibv_query_gid");
	connect_rc_qp(qp, qp->qp_num, &gid, gid_index);

	for (int c = 0; c < chains; c++) {
		struct ibv_sge sge[CHAIN];
		struct ibv_recv_wr recv[CHAIN], *bad_recv = NULL;
		for (int i = 0; i < CHAIN; i++) {
			sge[i] = (struct ibv_sge){ (uintptr_t)buf + (CHAIN + i) * MESSAGE, MESSAGE,
						   mr->lkey };
			recv[i] = (struct ibv_recv_wr){ .wr_id = i, .sg_list = &sge[i], .num_sge = 1,
							.next = i + 1 < CHAIN ? &recv[i + 1] : NULL };
		}
		usleep(20000);
		CHECK(!ibv_post_recv(qp, recv, &bad_recv), "ibv_post_recv of a chain");

		/* The last SEND has more SGEs than the QP takes: refused at posting, with the
		 * ones before it posted. */
		struct ibv_sge send_sge[CHAIN + 1];
		struct ibv_send_wr send[CHAIN], *bad_send = NULL;
		for (int i = 0; i <= CHAIN; i++)
			send_sge[i] = (struct ibv_sge){ (uintptr_t)buf + (i % CHAIN) * MESSAGE,
							 MESSAGE, mr->lkey };
		for (int i = 0; i < CHAIN; i++)
			send[i] = (struct ibv_send_wr){ .wr_id = i, .sg_list = &send_sge[i],
							.num_sge = i + 1 < CHAIN ? 1 : 2,
							.opcode = IBV_WR_SEND,
							.next = i + 1 < CHAIN ? &send[i + 1] : NULL };
		usleep(20000);
		CHECK(ibv_post_send(qp, send, &bad_send) == EINVAL, "EINVAL for too many SGEs");
		CHECK(bad_send == &send[CHAIN - 1], "bad_wr at the refused request");
		expect_completions(2 * (CHAIN - 1), CHAIN);
		/* One receive is left: a last SEND of its own takes it. */
		send[0].next = NULL;
		CHECK(!ibv_post_send(qp, send, &bad_send), "ibv_post_send of one");
		expect_completions(2, CHAIN);
	}

	/* A chain one longer than the send queue the device granted: a full queue is ENOMEM,
	 * as rxe and mlx5 say it, with the requests before it posted. */
	int depth = init.cap.max_send_wr;
	CHECK(depth >= CHAIN && depth < 2 * CHAIN, "a send queue of the depth asked for");
	struct ibv_sge write_sge = { (uintptr_t)buf, MESSAGE, mr->lkey };
	struct ibv_send_wr write[2 * CHAIN], *bad_write = NULL;
	for (int i = 0; i <= depth; i++)
		write[i] = (struct ibv_send_wr){
			.wr_id = i, .sg_list = &write_sge, .num_sge = 1,
			.opcode = IBV_WR_RDMA_WRITE, .next = i < depth ? &write[i + 1] : NULL,
			.wr.rdma = { (uintptr_t)buf + CHAIN * MESSAGE, mr->rkey },
		};
	CHECK(ibv_post_send(qp, write, &bad_write) == ENOMEM, "ENOMEM past the send queue's room");
	CHECK(bad_write == &write[depth], "bad_wr at the first request with no room");
	expect_completions(depth, depth);

	ibv_destroy_qp(qp);
	ibv_dereg_mr(mr);
	ibv_destroy_cq(cq);
	ibv_dealloc_pd(pd);
	ibv_close_device(ctx);
	printf("post_list: ok\n");
	return 0;
}
