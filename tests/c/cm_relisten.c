/* A server that destroys its listener and listens again on the same port, as perftest -R
 * does between its two connections: a connection request that comes in between is taken by
 * the new listener (vrdma's librdmacm keeps a destroyed listener listening for 2 s for a
 * bind in the same process to take over), and one that comes when no new listener followed
 * is refused once that time is up, not left waiting.
 * The client connects once; once the server destroyed its listener, connects again (it
 * waits 200 ms; the server listens again 500 ms after the destroy); once the server destroyed
 * that listener too, connects a third time and must be refused; then disconnects.
 * usage: cm_relisten server|client ADDRESS PORT; prints "cm_relisten: ok" at the end. */
#include "cm_checks.h"
#include <unistd.h>

static const struct ibv_qp_init_attr qp_attr = {
	.qp_type = IBV_QPT_RC,
	.cap = { .max_send_wr = 1, .max_recv_wr = 1, .max_send_sge = 1, .max_recv_sge = 1 },
};

/* A listener bound to `address`. */
static struct rdma_cm_id *listen_on(struct rdma_event_channel *channel, struct sockaddr *address)
{
	struct rdma_cm_id *listener;
	CHECK(rdma_create_id(channel, &listener, NULL, RDMA_PS_TCP) == 0, "rdma_create_id");
	CHECK(rdma_bind_addr(listener, address) == 0, "rdma_bind_addr");
	CHECK(rdma_listen(listener, 1) == 0, "rdma_listen");
	return listener;
}

/* Accepts the next connection request on `channel`; returns the connected id. */
static struct rdma_cm_id *accept_next(struct rdma_event_channel *channel)
{
	struct rdma_cm_id *id = expect_event(channel, RDMA_CM_EVENT_CONNECT_REQUEST);
	struct ibv_qp_init_attr attr = qp_attr;
	CHECK(rdma_create_qp(id, NULL, &attr) == 0, "rdma_create_qp");
	struct rdma_conn_param param = { .retry_count = 7, .rnr_retry_count = 7 };
	CHECK(rdma_accept(id, &param) == 0, "rdma_accept");
	CHECK(expect_event(channel, RDMA_CM_EVENT_ESTABLISHED) == id, "ESTABLISHED on the id");
	return id;
}

static void close_connection(struct rdma_cm_id *id)
{
	rdma_destroy_qp(id);
	CHECK(rdma_destroy_id(id) == 0, "rdma_destroy_id");
}

/* A connection to `address`, whose answer must be `outcome`; NULL unless established. */
static struct rdma_cm_id *connect_to(struct rdma_event_channel *channel, struct sockaddr *address,
				     enum rdma_cm_event_type outcome)
{
	struct rdma_cm_id *id;
	CHECK(rdma_create_id(channel, &id, NULL, RDMA_PS_TCP) == 0, "rdma_create_id");
	CHECK(rdma_resolve_addr(id, NULL, address, 2000) == 0, "rdma_resolve_addr");
	expect_event(channel, RDMA_CM_EVENT_ADDR_RESOLVED);
	CHECK(rdma_resolve_route(id, 2000) == 0, "rdma_resolve_route");
	expect_event(channel, RDMA_CM_EVENT_ROUTE_RESOLVED);
	struct ibv_qp_init_attr attr = qp_attr;
	CHECK(rdma_create_qp(id, NULL, &attr) == 0, "rdma_create_qp");
	struct rdma_conn_param param = { .retry_count = 7, .rnr_retry_count = 7 };
	CHECK(rdma_connect(id, &param) == 0, "rdma_connect");
	expect_event(channel, outcome);
	if (outcome == RDMA_CM_EVENT_ESTABLISHED)
		return id;
	close_connection(id);
	return NULL;
}

int main(int argc, char **argv)
{
	CHECK(argc == 4, "usage: cm_relisten server|client ADDRESS PORT");
	struct sockaddr_in address = { .sin_family = AF_INET, .sin_port = htons(atoi(argv[3])) };
	CHECK(inet_pton(AF_INET, argv[2], &address.sin_addr) == 1, "the address");
	struct sockaddr *to = (struct sockaddr *)&address;
	struct rdma_event_channel *channel = rdma_create_event_channel();
	CHECK(channel, "rdma_create_event_channel");
	struct rdma_cm_id *first, *second;
	if (!strcmp(argv[1], "server")) {
		struct rdma_cm_id *listener = listen_on(channel, to);
		first = accept_next(channel);
		CHECK(rdma_destroy_id(listener) == 0, "rdma_destroy_id (the first listener)");
		usleep(500 * 1000); /* the client's second request comes meanwhile */
		listener = listen_on(channel, to);
		second = accept_next(channel);
		CHECK(rdma_destroy_id(listener) == 0, "rdma_destroy_id (the second listener)");
		for (int i = 0; i < 2; i++) /* each answered, so the client's disconnect completes */
			rdma_disconnect(expect_event(channel, RDMA_CM_EVENT_DISCONNECTED));
	} else {
		first = connect_to(channel, to, RDMA_CM_EVENT_ESTABLISHED);
		usleep(200 * 1000);
		second = connect_to(channel, to, RDMA_CM_EVENT_ESTABLISHED);
		usleep(300 * 1000);
		connect_to(channel, to, RDMA_CM_EVENT_REJECTED);
		CHECK(rdma_disconnect(first) == 0, "rdma_disconnect");
		expect_event(channel, RDMA_CM_EVENT_DISCONNECTED);
		CHECK(rdma_disconnect(second) == 0, "rdma_disconnect");
		expect_event(channel, RDMA_CM_EVENT_DISCONNECTED);
	}
	close_connection(first);
	close_connection(second);
	rdma_destroy_event_channel(channel);
	printf("cm_relisten: ok\n");
	return 0;
}
