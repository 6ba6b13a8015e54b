/* The extended QP and CQ APIs (ibv_create_qp_ex + ibv_wr_*, ibv_create_cq_ex + ibv_start_poll)
 * on a libibverbs device, checked byte by byte: two RC QPs of one context connected to each
 * other, then SEND, SEND with immediate, RDMA WRITE (also through an MR at another IOVA), RDMA READ, fetch-and-add, compare-and-swap
 * and an inline SEND, each through ibv_wr_start .. ibv_wr_complete, their completions read
 * through the ibv_cq_ex poll API (and ibv_poll_cq on the same CQ). Written against libibverbs
 * only; tests/tests/ibverbs_rxe.rs builds it and runs it on vrdma0 through vrdma-run.
 * usage: qp_ex DEVICE GID_INDEX; prints "qp_ex: ok" and exits 0 when every check holds. */
#include "checks.h"
#include <endian.h>

enum { BUF = 8192, SEND_AT = 0, RECV_AT = 4096, WRITE_AT = 5000, READ_AT = 6000,
       ATOMIC_AT = 7000, RESULT_AT = 7100, IOVA_WRITE_AT = 7400 };

static struct ibv_cq_ex *cq;
static uint32_t receiver_qpn;

/* Waits for `n` successful completions through the poll API, checking what a receive
 * completion says; returns the immediate of the last one that carried one. */
static uint32_t wait_completions(int n, uint32_t received_len)
{
	uint32_t imm = 0;
	for (int done = 0; done < n;) {
		struct ibv_poll_cq_attr attr = {};
		int ret = ibv_start_poll(cq, &attr);
		if (ret == ENOENT)
			continue;
		CHECK(ret == 0, "ibv_start_poll");
		do {
			if (cq->status != IBV_WC_SUCCESS) {
				fprintf(stderr, "qp_ex: wr %llu: %s\n", (unsigned long long)cq->wr_id,
					ibv_wc_status_str(cq->status));
				exit(1);
			}
			if (cq->wr_id == 100) {
				CHECK(ibv_wc_read_opcode(cq) == IBV_WC_RECV, "a receive's opcode");
				CHECK(ibv_wc_read_byte_len(cq) == received_len, "a receive's length");
				CHECK(ibv_wc_read_qp_num(cq) == receiver_qpn, "a receive's QP");
				if (ibv_wc_read_wc_flags(cq) & IBV_WC_WITH_IMM)
					imm = be32toh(ibv_wc_read_imm_data(cq));
			}
			done++;
		} while (done < n && (ret = ibv_next_poll(cq)) == 0);
		CHECK(ret == 0 || ret == ENOENT, "ibv_next_poll");
		ibv_end_poll(cq);
	}
	/* The plain API on the same CQ sees nothing left. */
	struct ibv_wc wc;
	CHECK(ibv_poll_cq(ibv_cq_ex_to_cq(cq), 1, &wc) == 0, "an empty CQ");
	return imm;
}

int main(int argc, char **argv)
{
	CHECK(argc == 3, "usage: qp_ex DEVICE GID_INDEX");
	int gid_index = atoi(argv[2]);
	struct ibv_context *ctx = open_device_named(argv[1]);
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	CHECK(pd, "ibv_alloc_pd");
	struct ibv_cq_init_attr_ex cq_attr = {
		.cqe = 16,
		.wc_flags = IBV_WC_EX_WITH_BYTE_LEN | IBV_WC_EX_WITH_IMM | IBV_WC_EX_WITH_QP_NUM,
	};
	cq = ibv_create_cq_ex(ctx, &cq_attr);
	CHECK(cq, "ibv_create_cq_ex");
	uint8_t *buf = aligned_alloc(4096, BUF);
	CHECK(buf, "aligned_alloc");
	memset(buf, 0, BUF);
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, BUF, IBV_ACCESS_LOCAL_WRITE |
				       IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
				       IBV_ACCESS_REMOTE_ATOMIC);
	CHECK(mr, "ibv_reg_mr");

	struct ibv_qp *qp[2];
	for (int i = 0; i < 2; i++) {
		struct ibv_qp_init_attr_ex attr = {
			.send_cq = ibv_cq_ex_to_cq(cq), .recv_cq = ibv_cq_ex_to_cq(cq), .qp_type = IBV_QPT_RC, .pd = pd,
			.cap = { .max_send_wr = 8, .max_recv_wr = 8, .max_send_sge = 1,
				 .max_recv_sge = 1, .max_inline_data = 64 },
			.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
			.send_ops_flags = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_RDMA_WRITE |
					  IBV_QP_EX_WITH_RDMA_READ |
					  IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD |
					  IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP,
		};
		qp[i] = ibv_create_qp_ex(ctx, &attr);
		CHECK(qp[i], "ibv_create_qp_ex");
	}
	union ibv_gid gid;
	CHECK(!ibv_query_gid(ctx, 1, gid_index, &gid), "ibv_query_gid");
	connect_rc_qp(qp[0], qp[1]->qp_num, &gid, gid_index);
	connect_rc_qp(qp[1], qp[0]->qp_num, &gid, gid_index);
	receiver_qpn = qp[1]->qp_num;
	struct ibv_qp_ex *qpx = ibv_qp_to_qp_ex(qp[0]);
	CHECK(qpx, "ibv_qp_to_qp_ex");
	uint64_t base = (uintptr_t)buf;
	struct ibv_sge recv_sge = { .addr = base + RECV_AT, .length = 64, .lkey = mr->lkey };
	struct ibv_recv_wr recv = { .wr_id = 100, .sg_list = &recv_sge, .num_sge = 1 }, *bad;

	/* SEND */
	CHECK(!ibv_post_recv(qp[1], &recv, &bad), "ibv_post_recv");
	strcpy((char *)buf + SEND_AT, "send through ibv_wr_send");
	ibv_wr_start(qpx);
	qpx->wr_id = 1;
	qpx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_send(qpx);
	ibv_wr_set_sge(qpx, mr->lkey, base + SEND_AT, 32);
	CHECK(!ibv_wr_complete(qpx), "ibv_wr_complete (send)");
	wait_completions(2, 32);
	CHECK(!strcmp((char *)buf + RECV_AT, "send through ibv_wr_send"), "received bytes");

	/* SEND with immediate */
	CHECK(!ibv_post_recv(qp[1], &recv, &bad), "ibv_post_recv");
	ibv_wr_start(qpx);
	qpx->wr_id = 7;
	qpx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_send_imm(qpx, htobe32(0x1234abcd));
	ibv_wr_set_sge(qpx, mr->lkey, base + SEND_AT, 16);
	CHECK(!ibv_wr_complete(qpx), "ibv_wr_complete (send with immediate)");
	CHECK(wait_completions(2, 16) == 0x1234abcd, "the immediate received");

	/* RDMA WRITE */
	strcpy((char *)buf + SEND_AT, "written through ibv_wr_rdma_write");
	ibv_wr_start(qpx);
	qpx->wr_id = 2;
	ibv_wr_rdma_write(qpx, mr->rkey, base + WRITE_AT);
	ibv_wr_set_sge(qpx, mr->lkey, base + SEND_AT, 40);
	CHECK(!ibv_wr_complete(qpx), "ibv_wr_complete (write)");
	wait_completions(1, 0);
	CHECK(!strcmp((char *)buf + WRITE_AT, "written through ibv_wr_rdma_write"), "written bytes");

	/* RDMA WRITE through an MR registered at another IOVA (ibv_reg_mr_iova2): both the
	 * local SGE and the remote address are in the IOVA's space. */
	const uint64_t iova = 0x7e0000000000ull;
	errno = 0;
	CHECK(!ibv_reg_mr_iova2(pd, buf, BUF, iova + 1, IBV_ACCESS_LOCAL_WRITE) && errno == EINVAL,
	      "refusing an IOVA at another offset within the page");
	struct ibv_mr *at_iova = ibv_reg_mr_iova2(pd, buf, BUF, iova, IBV_ACCESS_LOCAL_WRITE |
						  IBV_ACCESS_REMOTE_WRITE);
	CHECK(at_iova, "ibv_reg_mr_iova2");
	strcpy((char *)buf + SEND_AT, "written at an IOVA");
	ibv_wr_start(qpx);
	qpx->wr_id = 8;
	ibv_wr_rdma_write(qpx, at_iova->rkey, iova + IOVA_WRITE_AT);
	ibv_wr_set_sge(qpx, at_iova->lkey, iova + SEND_AT, 20);
	CHECK(!ibv_wr_complete(qpx), "ibv_wr_complete (write at an IOVA)");
	wait_completions(1, 0);
	CHECK(!strcmp((char *)buf + IOVA_WRITE_AT, "written at an IOVA"), "bytes written at an IOVA");
	CHECK(!ibv_dereg_mr(at_iova), "ibv_dereg_mr (IOVA)");

	/* RDMA READ */
	strcpy((char *)buf + READ_AT, "read through ibv_wr_rdma_read");
	ibv_wr_start(qpx);
	qpx->wr_id = 3;
	ibv_wr_rdma_read(qpx, mr->rkey, base + READ_AT);
	ibv_wr_set_sge(qpx, mr->lkey, base + RESULT_AT + 64, 32);
	CHECK(!ibv_wr_complete(qpx), "ibv_wr_complete (read)");
	wait_completions(1, 0);
	CHECK(!strcmp((char *)buf + RESULT_AT + 64, "read through ibv_wr_rdma_read"), "read bytes");

	/* Atomics, both in one batch: 5 + 3 = 8, then 8 -> 42. */
	*(uint64_t *)(buf + ATOMIC_AT) = 5;
	ibv_wr_start(qpx);
	qpx->wr_id = 4;
	ibv_wr_atomic_fetch_add(qpx, mr->rkey, base + ATOMIC_AT, 3);
	ibv_wr_set_sge(qpx, mr->lkey, base + RESULT_AT, 8);
	qpx->wr_id = 5;
	ibv_wr_atomic_cmp_swp(qpx, mr->rkey, base + ATOMIC_AT, 8, 42);
	ibv_wr_set_sge(qpx, mr->lkey, base + RESULT_AT + 8, 8);
	CHECK(!ibv_wr_complete(qpx), "ibv_wr_complete (atomics)");
	wait_completions(2, 0);
	CHECK(*(uint64_t *)(buf + RESULT_AT) == 5, "fetch-and-add's old value");
	CHECK(*(uint64_t *)(buf + RESULT_AT + 8) == 8, "compare-and-swap's old value");
	CHECK(*(uint64_t *)(buf + ATOMIC_AT) == 42, "the atomic's final value");

#ifndef SKIP_INLINE /* rxe's own provider does not mark wr_* inline sends inline */
	/* Inline SEND: the bytes are copied at ibv_wr_set_inline_data (ibv_wr_post(3)). */
	memset(buf + RECV_AT, 0, 64);
	CHECK(!ibv_post_recv(qp[1], &recv, &bad), "ibv_post_recv");
	char inline_data[] = "inline through ibv_wr_set_inline_data";
	ibv_wr_start(qpx);
	qpx->wr_id = 6;
	ibv_wr_send(qpx);
	ibv_wr_set_inline_data(qpx, inline_data, sizeof inline_data);
	memset(inline_data, 'x', sizeof inline_data - 1);
	CHECK(!ibv_wr_complete(qpx), "ibv_wr_complete (inline)");
	wait_completions(2, sizeof inline_data);
	CHECK(!strcmp((char *)buf + RECV_AT, "inline through ibv_wr_set_inline_data"), "inline bytes");
#endif

	/* A batch that is aborted posts nothing. */
	ibv_wr_start(qpx);
	ibv_wr_send(qpx);
	ibv_wr_set_sge(qpx, mr->lkey, base + SEND_AT, 8);
	ibv_wr_abort(qpx);

	/* Refusals as libibverbs makes them: the errno returned is also left in errno. */
	struct ibv_qp_attr back_to_rtr = { .qp_state = IBV_QPS_RTR };
	errno = 0;
	CHECK(ibv_modify_qp(qp[1], &back_to_rtr, IBV_QP_STATE) == EINVAL && errno == EINVAL,
	      "ibv_modify_qp from RTS to RTR: EINVAL");
	errno = 0;
	CHECK(ibv_destroy_cq(ibv_cq_ex_to_cq(cq)) == EBUSY && errno == EBUSY,
	      "ibv_destroy_cq while QPs complete there: EBUSY");
	errno = 0;
	CHECK(ibv_dealloc_pd(pd) == EBUSY && errno == EBUSY,
	      "ibv_dealloc_pd while an MR and QPs use it: EBUSY");

	for (int i = 0; i < 2; i++)
		CHECK(!ibv_destroy_qp(qp[i]), "ibv_destroy_qp");
	errno = 0;
	CHECK(ibv_dealloc_pd(pd) == EBUSY && errno == EBUSY, "ibv_dealloc_pd while an MR uses it: EBUSY");
	CHECK(!ibv_dereg_mr(mr), "ibv_dereg_mr");
	CHECK(!ibv_destroy_cq(ibv_cq_ex_to_cq(cq)), "ibv_destroy_cq");
	CHECK(!ibv_dealloc_pd(pd), "ibv_dealloc_pd");
	CHECK(!ibv_close_device(ctx), "ibv_close_device");
	printf("qp_ex: ok\n");
	return 0;
}
