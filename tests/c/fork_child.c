/* A child forked from a program that has the device open, using its parent's context (as a
 * program forking a worker may): natively only the child fails, and so must it on vrdma,
 * with nothing sent on the parent's connection or queues. Written against libibverbs only;
 * tests/tests/guest_service_rxe.rs runs it on vrdma0 through vrdma-run, attached directly to
 * a backend and through the guest service.
 * usage: fork_child DEVICE GID_INDEX
 * The parent makes a PD, a CQ, an MR and an RC QP connected to itself, then forks. The child
 * calls ibv_alloc_pd, ibv_reg_mr, ibv_create_cq, ibv_query_port, ibv_post_recv,
 * ibv_post_send, ibv_req_notify_cq and ibv_poll_cq on its parent's context and objects: each
 * must fail (it prints each that does not); then it destroys its copies of the objects and
 * closes its copy of the context, which must neither hang nor reach the device, and exits 0
 * when every call failed. The parent then makes 20 checked RDMA WRITEs to itself through its
 * QP, registers another MR, and prints "fork: ok". Any failure exits 1. */
#include "checks.h"
#include <sys/wait.h>
#include <unistd.h>

#define BYTES 4096

static int failures;

/* Counts `call` a failure of the child's test when it succeeded. */
static void must_fail(int failed, const char *call)
{
	if (failed) {
		printf("child: %s failed (errno %d): ok\n", call, errno);
	} else {
		printf("child: %s succeeded on its parent's context\n", call);
		failures++;
	}
	fflush(stdout);
}

static void child(struct ibv_context *context, struct ibv_pd *pd, struct ibv_cq *cq,
		  struct ibv_qp *qp, struct ibv_mr *mr, char *buffer)
{
	errno = 0;
	struct ibv_pd *other_pd = ibv_alloc_pd(context);
	must_fail(!other_pd, "ibv_alloc_pd");
	static char more[BYTES] __attribute__((aligned(4096)));
	must_fail(!ibv_reg_mr(pd, more, sizeof more, IBV_ACCESS_LOCAL_WRITE), "ibv_reg_mr");
	must_fail(!ibv_create_cq(context, 16, NULL, NULL, 0), "ibv_create_cq");
	struct ibv_port_attr port;
	must_fail(ibv_query_port(context, 1, &port) != 0, "ibv_query_port");
	struct ibv_sge sge = { .addr = (uintptr_t)buffer, .length = 64, .lkey = mr->lkey };
	struct ibv_recv_wr recv = { .wr_id = 1, .sg_list = &sge, .num_sge = 1 }, *bad_recv;
	must_fail(ibv_post_recv(qp, &recv, &bad_recv) != 0, "ibv_post_recv");
	struct ibv_send_wr send = { .wr_id = 2, .sg_list = &sge, .num_sge = 1,
				    .opcode = IBV_WR_RDMA_WRITE, .send_flags = IBV_SEND_SIGNALED,
				    .wr.rdma = { .remote_addr = (uintptr_t)buffer + BYTES / 2,
						 .rkey = mr->rkey } },
			   *bad_send;
	must_fail(ibv_post_send(qp, &send, &bad_send) != 0, "ibv_post_send");
	must_fail(ibv_req_notify_cq(cq, 0) != 0, "ibv_req_notify_cq");
	struct ibv_wc wc;
	must_fail(ibv_poll_cq(cq, 1, &wc) < 0, "ibv_poll_cq");
	/* The child's copies go; its parent's objects stay. */
	ibv_destroy_qp(qp);
	ibv_dereg_mr(mr);
	ibv_destroy_cq(cq);
	ibv_dealloc_pd(pd);
	ibv_close_device(context);
	printf("child: done, %d calls succeeded\n", failures);
	fflush(stdout);
	_exit(failures ? 1 : 0);
}

int main(int argc, char **argv)
{
	if (argc != 3) {
		fprintf(stderr, "usage: fork_child DEVICE GID_INDEX\n");
		return 2;
	}
	int gid_index = atoi(argv[2]);
	struct ibv_context *context = open_device_named(argv[1]);
	struct ibv_pd *pd = ibv_alloc_pd(context);
	CHECK(pd, "ibv_alloc_pd");
	struct ibv_cq *cq = ibv_create_cq(context, 16, NULL, NULL, 0);
	CHECK(cq, "ibv_create_cq");
	static char buffer[BYTES] __attribute__((aligned(4096)));
	struct ibv_mr *mr = ibv_reg_mr(pd, buffer, sizeof buffer,
				       IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
	CHECK(mr, "ibv_reg_mr");
	struct ibv_qp_init_attr init = {
		.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	struct ibv_qp *qp = ibv_create_qp(pd, &init);
	CHECK(qp, "ibv_create_qp");
	union ibv_gid gid;
	CHECK(!ibv_query_gid(context, 1, gid_index, &gid), "ibv_query_gid");
	connect_rc_qp(qp, qp->qp_num, &gid, gid_index);
	fflush(stdout);

	pid_t forked = fork();
	CHECK(forked >= 0, "fork");
	if (forked == 0)
		child(context, pd, cq, qp, mr, buffer);
	int status;
	CHECK(waitpid(forked, &status, 0) == forked, "waitpid");
	CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "every verb failing in the child");

	/* The parent's device, connection and queues are as they were. */
	for (int i = 0; i < 20; i++) {
		memset(buffer, 'a' + i, BYTES / 2);
		memset(buffer + BYTES / 2, 0, BYTES / 2);
		struct ibv_sge sge = { .addr = (uintptr_t)buffer, .length = BYTES / 2,
				       .lkey = mr->lkey };
		struct ibv_send_wr wr = { .wr_id = i, .sg_list = &sge, .num_sge = 1,
					  .opcode = IBV_WR_RDMA_WRITE,
					  .send_flags = IBV_SEND_SIGNALED,
					  .wr.rdma = { .remote_addr = (uintptr_t)buffer + BYTES / 2,
						       .rkey = mr->rkey } },
				   *bad;
		CHECK(!ibv_post_send(qp, &wr, &bad), "the parent's ibv_post_send");
		struct ibv_wc wc;
		int polled, polls = 0;
		while ((polled = ibv_poll_cq(cq, 1, &wc)) == 0)
			CHECK(++polls < 300000000, "the parent's completion");
		CHECK(polled == 1 && wc.status == IBV_WC_SUCCESS && wc.wr_id == (uint64_t)i,
		      "the parent's WRITE completes");
		for (int at = BYTES / 2; at < BYTES; at++)
			CHECK(buffer[at] == 'a' + i, "the parent's WRITE landed");
	}
	static char more[BYTES] __attribute__((aligned(4096)));
	struct ibv_mr *another = ibv_reg_mr(pd, more, sizeof more, IBV_ACCESS_LOCAL_WRITE);
	CHECK(another, "the parent's ibv_reg_mr after the fork");
	CHECK(!ibv_dereg_mr(another), "ibv_dereg_mr");
	CHECK(!ibv_destroy_qp(qp), "ibv_destroy_qp");
	CHECK(!ibv_dereg_mr(mr), "ibv_dereg_mr");
	CHECK(!ibv_destroy_cq(cq), "ibv_destroy_cq");
	CHECK(!ibv_dealloc_pd(pd), "ibv_dealloc_pd");
	CHECK(!ibv_close_device(context), "ibv_close_device");
	printf("fork: ok\n");
	return 0;
}
