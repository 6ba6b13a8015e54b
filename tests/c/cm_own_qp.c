/* rdma_cm with a QP the program makes and moves itself (ibv_create_qp, rdma_init_qp_attr,
 * conn_param.qp_num, rdma_establish at CONNECT_RESPONSE), as programs that keep their QPs
 * out of librdmacm do (UCX, libfabric's shared receive contexts): no Debian binary does.
 * The client sends a message, the server answers it, the client disconnects.
 * usage: cm_own_qp server|client ADDRESS PORT   (the server binds ADDRESS, the client
 *        connects to it); prints "cm_own_qp: ok" at the end of a clean run. */
#include "cm_checks.h"

#define MESSAGE "a message on the program's own QP"
#define ANSWER "an answer on the program's own QP"

/* Moves `qp` to `state` with the connection manager's attributes for it. */
static void move_qp(struct rdma_cm_id *id, struct ibv_qp *qp, enum ibv_qp_state state)
{
	struct ibv_qp_attr attr = { .qp_state = state };
	int mask;
	CHECK(rdma_init_qp_attr(id, &attr, &mask) == 0, "rdma_init_qp_attr");
	CHECK(ibv_modify_qp(qp, &attr, mask) == 0, "ibv_modify_qp");
}

struct connection {
	struct ibv_pd *pd;
	struct ibv_cq *cq;
	struct ibv_qp *qp;
	struct ibv_mr *mr;
	char buffer[2][64]; /* [0] received into, [1] sent from */
};

/* The program's own objects on the id's device, its QP in INIT with a receive posted. */
static void make_objects(struct rdma_cm_id *id, struct connection *c)
{
	struct ibv_qp_init_attr init = {
		.qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 2, .max_recv_wr = 2, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	CHECK(c->pd = ibv_alloc_pd(id->verbs), "ibv_alloc_pd");
	CHECK(c->cq = ibv_create_cq(id->verbs, 4, NULL, NULL, 0), "ibv_create_cq");
	init.send_cq = init.recv_cq = c->cq;
	CHECK(c->qp = ibv_create_qp(c->pd, &init), "ibv_create_qp");
	CHECK(c->mr = ibv_reg_mr(c->pd, c->buffer, sizeof(c->buffer), IBV_ACCESS_LOCAL_WRITE),
	      "ibv_reg_mr");
	move_qp(id, c->qp, IBV_QPS_INIT);
	struct ibv_sge sge = { (uintptr_t)c->buffer[0], sizeof(c->buffer[0]), c->mr->lkey };
	struct ibv_recv_wr wr = { .sg_list = &sge, .num_sge = 1 }, *bad;
	CHECK(ibv_post_recv(c->qp, &wr, &bad) == 0, "ibv_post_recv");
}

static struct rdma_conn_param param_of(const struct connection *c)
{
	return (struct rdma_conn_param){ .responder_resources = 1, .initiator_depth = 1,
					 .retry_count = 7, .rnr_retry_count = 7,
					 .qp_num = c->qp->qp_num };
}

/* Waits for one completion of `opcode`, which must have succeeded. */
static void complete(struct connection *c, enum ibv_wc_opcode opcode)
{
	struct ibv_wc wc;
	int n;
	for (int spins = 0; (n = ibv_poll_cq(c->cq, 1, &wc)) == 0; spins++)
		CHECK(spins < 100000000, "a completion in time");
	CHECK(n == 1 && wc.status == IBV_WC_SUCCESS && wc.opcode == opcode, "a completion");
}

static void send_text(struct connection *c, const char *text)
{
	strcpy(c->buffer[1], text);
	struct ibv_sge sge = { (uintptr_t)c->buffer[1], strlen(text) + 1, c->mr->lkey };
	struct ibv_send_wr wr = { .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND,
				  .send_flags = IBV_SEND_SIGNALED },
			   *bad;
	CHECK(ibv_post_send(c->qp, &wr, &bad) == 0, "ibv_post_send");
	complete(c, IBV_WC_SEND);
}

static void receive_text(struct connection *c, const char *expected)
{
	complete(c, IBV_WC_RECV);
	CHECK(strcmp(c->buffer[0], expected) == 0, "the message received");
}

static void destroy_objects(struct connection *c)
{
	CHECK(ibv_destroy_qp(c->qp) == 0, "ibv_destroy_qp");
	CHECK(ibv_dereg_mr(c->mr) == 0, "ibv_dereg_mr");
	CHECK(ibv_destroy_cq(c->cq) == 0, "ibv_destroy_cq");
	CHECK(ibv_dealloc_pd(c->pd) == 0, "ibv_dealloc_pd");
}

int main(int argc, char **argv)
{
	CHECK(argc == 4, "usage: cm_own_qp server|client ADDRESS PORT");
	struct sockaddr_in address = { .sin_family = AF_INET, .sin_port = htons(atoi(argv[3])) };
	CHECK(inet_pton(AF_INET, argv[2], &address.sin_addr) == 1, "the address");
	struct rdma_event_channel *channel = rdma_create_event_channel();
	CHECK(channel, "rdma_create_event_channel");
	struct rdma_cm_id *id, *listener = NULL;
	CHECK(rdma_create_id(channel, &id, NULL, RDMA_PS_TCP) == 0, "rdma_create_id");
	struct connection c;
	struct rdma_conn_param param;
	if (!strcmp(argv[1], "server")) {
		listener = id;
		CHECK(rdma_bind_addr(listener, (struct sockaddr *)&address) == 0, "rdma_bind_addr");
		CHECK(rdma_listen(listener, 1) == 0, "rdma_listen");
		id = expect_event(channel, RDMA_CM_EVENT_CONNECT_REQUEST);
		make_objects(id, &c);
		/* Accepted with the QP ready to send: RTR and RTS are the program's to make. */
		move_qp(id, c.qp, IBV_QPS_RTR);
		move_qp(id, c.qp, IBV_QPS_RTS);
		param = param_of(&c);
		CHECK(rdma_accept(id, &param) == 0, "rdma_accept");
		expect_event(channel, RDMA_CM_EVENT_ESTABLISHED);
		receive_text(&c, MESSAGE);
		send_text(&c, ANSWER);
		expect_event(channel, RDMA_CM_EVENT_DISCONNECTED);
		rdma_disconnect(id); /* the QP to ERROR, as librdmacm's for its own QPs */
	} else {
		CHECK(rdma_resolve_addr(id, NULL, (struct sockaddr *)&address, 2000) == 0,
		      "rdma_resolve_addr");
		expect_event(channel, RDMA_CM_EVENT_ADDR_RESOLVED);
		CHECK(rdma_resolve_route(id, 2000) == 0, "rdma_resolve_route");
		expect_event(channel, RDMA_CM_EVENT_ROUTE_RESOLVED);
		make_objects(id, &c);
		param = param_of(&c);
		CHECK(rdma_connect(id, &param) == 0, "rdma_connect");
		/* No QP of librdmacm's on the id: the response is the program's to complete. */
		expect_event(channel, RDMA_CM_EVENT_CONNECT_RESPONSE);
		move_qp(id, c.qp, IBV_QPS_RTR);
		move_qp(id, c.qp, IBV_QPS_RTS);
		CHECK(rdma_establish(id) == 0, "rdma_establish");
		send_text(&c, MESSAGE);
		receive_text(&c, ANSWER);
		CHECK(rdma_disconnect(id) == 0, "rdma_disconnect");
		expect_event(channel, RDMA_CM_EVENT_DISCONNECTED);
	}
	destroy_objects(&c);
	CHECK(rdma_destroy_id(id) == 0, "rdma_destroy_id");
	if (listener)
		CHECK(rdma_destroy_id(listener) == 0, "rdma_destroy_id (the listener)");
	rdma_destroy_event_channel(channel);
	printf("cm_own_qp: ok\n");
	return 0;
}
