/* Asynchronous events (ibv_get_async_event) of a libibverbs device, as a program sees them.
 * Written against libibverbs only; tests/tests/ibverbs_rxe.rs builds it and runs it on vrdma0
 * through vrdma-run.
 * usage: async_events DEVICE qp-fatal   a send with a bad lkey: an error completion, then
 *                                       IBV_EVENT_QP_FATAL naming the QP; prints "qp-fatal: ok"
 *        async_events DEVICE port       prints "ready", then waits for IBV_EVENT_PORT_ERR and
 *                                       IBV_EVENT_PORT_ACTIVE on port 1; prints "port: ok"
 *        async_events DEVICE fatal      prints "ready", then waits for IBV_EVENT_DEVICE_FATAL
 *                                       (the backend goes away); prints "device-fatal: ok"
 * Each wait gives up after 30 seconds; any failure exits 1. */
#include "checks.h"
#include <poll.h>

/* The next asynchronous event, waiting on async_fd first as an event loop would. */
static void next_event(struct ibv_context *context, struct ibv_async_event *event)
{
	struct pollfd ready = { .fd = context->async_fd, .events = POLLIN };
	CHECK(poll(&ready, 1, 30000) == 1, "poll(async_fd) within 30 s");
	CHECK(!ibv_get_async_event(context, event), "ibv_get_async_event");
	printf("event: %s\n", ibv_event_type_str(event->event_type));
	fflush(stdout);
}

static void expect_event(struct ibv_context *context, enum ibv_event_type type)
{
	struct ibv_async_event event;
	next_event(context, &event);
	CHECK(event.event_type == type, ibv_event_type_str(type));
	if (type == IBV_EVENT_PORT_ERR || type == IBV_EVENT_PORT_ACTIVE)
		CHECK(event.element.port_num == 1, "the event names port 1");
	ibv_ack_async_event(&event);
}

static void qp_fatal(struct ibv_context *context)
{
	struct ibv_pd *pd = ibv_alloc_pd(context);
	CHECK(pd, "ibv_alloc_pd");
	struct ibv_cq *cq = ibv_create_cq(context, 16, NULL, NULL, 0);
	CHECK(cq, "ibv_create_cq");
	struct ibv_qp_init_attr init = {
		.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	struct ibv_qp *qp = ibv_create_qp(pd, &init);
	CHECK(qp, "ibv_create_qp");
	/* Connected (to itself), so that the send is taken and then refused by the device. */
	union ibv_gid gid;
	CHECK(!ibv_query_gid(context, 1, 0, &gid), "ibv_query_gid");
	connect_rc_qp(qp, qp->qp_num, &gid, 0);
	static char buffer[64];
	struct ibv_sge sge = { .addr = (uintptr_t)buffer, .length = sizeof buffer,
			       .lkey = 0xdead00 };
	struct ibv_send_wr wr = { .wr_id = 7, .sg_list = &sge, .num_sge = 1,
				  .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED }, *bad;
	CHECK(!ibv_post_send(qp, &wr, &bad), "ibv_post_send");

	struct ibv_wc wc;
	int polls = 0;
	while (ibv_poll_cq(cq, 1, &wc) == 0)
		CHECK(++polls < 300000000, "an error completion");
	CHECK(wc.wr_id == 7 && wc.status != IBV_WC_SUCCESS, "the refused send completes in error");
	printf("completion: %s\n", ibv_wc_status_str(wc.status));

	struct ibv_async_event event;
	next_event(context, &event);
	CHECK(event.event_type == IBV_EVENT_QP_FATAL, "IBV_EVENT_QP_FATAL");
	CHECK(event.element.qp == qp, "the event names the QP");
	ibv_ack_async_event(&event);
	CHECK(!ibv_destroy_qp(qp), "ibv_destroy_qp");
	CHECK(!ibv_destroy_cq(cq), "ibv_destroy_cq");
	CHECK(!ibv_dealloc_pd(pd), "ibv_dealloc_pd");
	printf("qp-fatal: ok\n");
}

int main(int argc, char **argv)
{
	if (argc != 3) {
		fprintf(stderr, "usage: async_events DEVICE qp-fatal|port|fatal\n");
		return 2;
	}
	struct ibv_context *context = open_device_named(argv[1]);

	if (!strcmp(argv[2], "qp-fatal")) {
		qp_fatal(context);
	} else if (!strcmp(argv[2], "port")) {
		printf("ready\n");
		fflush(stdout);
		expect_event(context, IBV_EVENT_PORT_ERR);
		expect_event(context, IBV_EVENT_PORT_ACTIVE);
		printf("port: ok\n");
	} else if (!strcmp(argv[2], "fatal")) {
		printf("ready\n");
		fflush(stdout);
		expect_event(context, IBV_EVENT_DEVICE_FATAL);
		printf("device-fatal: ok\n");
	} else {
		fprintf(stderr, "async_events: unknown mode %s\n", argv[2]);
		return 2;
	}
	fflush(stdout);
	ibv_close_device(context);
	return 0;
}
