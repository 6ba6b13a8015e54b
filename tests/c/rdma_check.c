/* rdma_check: RC SEND/RECV, RDMA WRITE, RDMA READ, both atomics and UD between two machines,
 * every payload checked where it lands, each side known to the other only by the IP address
 * its GID carries. Written against libibverbs only: the same binary runs natively (rxe0) and
 * on vrdma0 through vrdma-run; tests/cross-host.sh runs it across two hosts.
 *
 * usage: rdma_check server|client -d DEVICE --local IP --peer IP --port TCP
 *                   [--link-fault NETDEV]
 *   --local IP       the source GID is the RoCEv2 GID of IP (found in the device's table)
 *   --peer IP        the peer's GID, given here rather than learnt from the peer: RC traffic
 *                    and UD source addresses are thereby checked against it
 *   --port TCP       the out-of-band exchange (QP numbers, keys), the server listening on it
 *                    and the client connecting to the peer's IP, retrying for 120 s
 *   --link-fault NETDEV  instead of the checks: the client streams RDMA WRITEs while the
 *                    server takes NETDEV down for 3 s; the client must see its WRITEs fail
 *                    with a retry-exceeded completion (no hang), then both sides make new QPs
 *                    and the SEND/RECV and WRITE checks must pass again. The client passes
 *                    "-" as NETDEV.
 * Prints "rdma_check: <phase> ok" per phase and "rdma_check: ok" at the end; any failure
 * prints what failed and exits 1. Every wait gives up after 60 s (120 s for the peer's TCP). */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <infiniband/verbs.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define CHECK(cond, ...)                                                                   \
	do {                                                                               \
		if (!(cond)) {                                                             \
			fprintf(stderr, "rdma_check: line %d: ", __LINE__);                \
			fprintf(stderr, __VA_ARGS__);                                      \
			fprintf(stderr, " (errno %d: %s)\n", errno, strerror(errno));      \
			exit(1);                                                           \
		}                                                                          \
	} while (0)

/* Layout of each side's registered buffer. */
enum {
	BUF_LEN = 1 << 20,
	MSG_LEN = 4096,
	RECV_SLOTS = 8,
	RECV_AREA = 0,                      /* RECV_SLOTS receive slots of MSG_LEN */
	SEND_AREA = RECV_SLOTS * MSG_LEN,   /* one outgoing message */
	WRITE_AREA = 64 << 10,              /* WRITE source (client) and target (server) */
	READ_AREA = 128 << 10,              /* READ target (client) and source (server) */
	RDMA_LEN = 64 << 10,
	ATOMIC_AREA = 192 << 10,            /* the server's counter; the client's results */
	UD_RECV_AREA = 256 << 10,           /* UD_SLOTS slots of GRH + UD_LEN */
	UD_SEND_AREA = 320 << 10,
	UD_LEN = 256,
	GRH_LEN = 40,
	UD_SLOTS = 4,
	UD_SLOT = 512,
	QKEY = 0x11111111,
	WAIT_MS = 60000,
};

/* wr_ids */
enum { WR_SEND = 1, WR_RDMA, WR_UD_SEND, WR_RECV = 100, WR_UD_RECV = 200 };

struct side {
	int server;
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_cq *cq;
	struct ibv_mr *mr;
	uint8_t *buf;
	struct ibv_qp *rc, *ud;
	int gid_index;
	union ibv_gid local_gid, peer_gid;
	uint32_t local_ip, peer_ip; /* network order */
	enum ibv_mtu mtu;
	int tcp;
	/* what the peer told us */
	uint32_t peer_rc_qpn, peer_ud_qpn, peer_psn, peer_rkey;
	uint64_t peer_addr;
};

static uint8_t pattern(int seed, size_t i)
{
	return (uint8_t)(seed * 131 + i * 7 + (i >> 8));
}

static void fill(uint8_t *p, size_t len, int seed)
{
	for (size_t i = 0; i < len; i++)
		p[i] = pattern(seed, i);
}

static void expect_pattern(const uint8_t *p, size_t len, int seed, const char *what)
{
	for (size_t i = 0; i < len; i++)
		CHECK(p[i] == pattern(seed, i), "%s: byte %zu is %#x, expected %#x", what, i, p[i],
		      pattern(seed, i));
}

static double now_ms(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static void gid_of_ip(uint32_t ip, union ibv_gid *gid)
{
	memset(gid, 0, sizeof(*gid));
	gid->raw[10] = gid->raw[11] = 0xff;
	memcpy(&gid->raw[12], &ip, 4);
}

/* The index of the RoCEv2 GID of the local address, looked up afresh (a link that went down
 * and up may have moved it). */
static int find_gid_index(struct side *s)
{
	struct ibv_port_attr port;
	CHECK(!ibv_query_port(s->ctx, 1, &port), "ibv_query_port");
	s->mtu = port.active_mtu;
	for (int i = 0; i < port.gid_tbl_len; i++) {
		union ibv_gid gid;
		if (ibv_query_gid(s->ctx, 1, i, &gid) == 0 &&
		    !memcmp(&gid, &s->local_gid, sizeof(gid)))
			return i;
	}
	CHECK(0, "the device has no GID for the local address");
	return -1;
}

/* ---- out-of-band exchange: one text line at a time ---- */

static void tcp_send(struct side *s, const char *format, ...)
{
	char line[256];
	va_list args;
	va_start(args, format);
	int len = vsnprintf(line, sizeof(line) - 1, format, args);
	va_end(args);
	line[len++] = '\n';
	CHECK(send(s->tcp, line, len, MSG_NOSIGNAL) == len, "send to the peer");
}

static void tcp_receive(struct side *s, char *line, size_t size)
{
	size_t len = 0;
	for (;;) {
		char c;
		ssize_t got = recv(s->tcp, &c, 1, 0);
		CHECK(got == 1, "the peer's next line");
		if (c == '\n')
			break;
		CHECK(len + 1 < size, "a line that long");
		line[len++] = c;
	}
	line[len] = 0;
}

static void tcp_expect(struct side *s, const char *expected)
{
	char line[256];
	tcp_receive(s, line, sizeof(line));
	CHECK(!strcmp(line, expected), "the peer said '%s', expected '%s'", line, expected);
}

static void tcp_connect(struct side *s, int port)
{
	struct timeval timeout = { .tv_sec = 120 };
	struct sockaddr_in address = { .sin_family = AF_INET, .sin_port = htons(port) };
	if (s->server) {
		int listener = socket(AF_INET, SOCK_STREAM, 0), one = 1;
		CHECK(listener >= 0, "socket");
		setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
		address.sin_addr.s_addr = htonl(INADDR_ANY);
		CHECK(!bind(listener, (struct sockaddr *)&address, sizeof(address)), "bind %d", port);
		CHECK(!listen(listener, 1), "listen");
		setsockopt(listener, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
		s->tcp = accept(listener, NULL, NULL);
		CHECK(s->tcp >= 0, "a client within 120 s");
		close(listener);
	} else {
		address.sin_addr.s_addr = s->peer_ip;
		double start = now_ms();
		for (;;) {
			s->tcp = socket(AF_INET, SOCK_STREAM, 0);
			CHECK(s->tcp >= 0, "socket");
			if (!connect(s->tcp, (struct sockaddr *)&address, sizeof(address)))
				break;
			close(s->tcp);
			CHECK(now_ms() - start < 120000, "connect to the server within 120 s");
			usleep(300000);
		}
	}
	setsockopt(s->tcp, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
}

/* ---- verbs ---- */

static void post_recv(struct side *s, struct ibv_qp *qp, uint64_t wr_id, uint64_t offset,
		      uint32_t len)
{
	struct ibv_sge sge = { (uintptr_t)s->buf + offset, len, s->mr->lkey };
	struct ibv_recv_wr wr = { .wr_id = wr_id, .sg_list = &sge, .num_sge = 1 }, *bad;
	CHECK(!ibv_post_recv(qp, &wr, &bad), "ibv_post_recv");
}

static void post_send(struct side *s, struct ibv_qp *qp, struct ibv_send_wr *wr,
		      uint64_t offset, uint32_t len)
{
	struct ibv_sge sge = { (uintptr_t)s->buf + offset, len, s->mr->lkey };
	struct ibv_send_wr *bad;
	wr->sg_list = &sge;
	wr->num_sge = 1;
	wr->send_flags |= IBV_SEND_SIGNALED;
	CHECK(!ibv_post_send(qp, wr, &bad), "ibv_post_send");
}

/* The next completion of the current QPs, within WAIT_MS (those of a QP replaced after a
 * fault are passed over); it must be `wr_id`'s or `other`'s, and successful. */
static struct ibv_wc await_either(struct side *s, uint64_t wr_id, uint64_t other)
{
	struct ibv_wc wc;
	double start = now_ms();
	int got;
	while ((got = ibv_poll_cq(s->cq, 1, &wc)) == 0 ||
	       (got == 1 && wc.qp_num != s->rc->qp_num && wc.qp_num != s->ud->qp_num))
		CHECK(now_ms() - start < WAIT_MS, "a completion for wr_id %lu within %d ms",
		      (unsigned long)wr_id, WAIT_MS);
	CHECK(got == 1, "ibv_poll_cq");
	CHECK(wc.status == IBV_WC_SUCCESS, "wr_id %lu completed with %s",
	      (unsigned long)wc.wr_id, ibv_wc_status_str(wc.status));
	CHECK(wc.wr_id == wr_id || wc.wr_id == other, "a completion for wr_id %lu, got %lu",
	      (unsigned long)wr_id, (unsigned long)wc.wr_id);
	return wc;
}

/* The next completion, which must be `wr_id`'s (see await_either). */
static struct ibv_wc await(struct side *s, uint64_t wr_id)
{
	return await_either(s, wr_id, wr_id);
}

static struct ibv_qp *create_qp(struct side *s, enum ibv_qp_type type)
{
	struct ibv_qp_init_attr init = {
		.send_cq = s->cq, .recv_cq = s->cq, .qp_type = type,
		.cap = { .max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 1,
			 .max_recv_sge = 1 },
	};
	struct ibv_qp *qp = ibv_create_qp(s->pd, &init);
	CHECK(qp, "ibv_create_qp");
	struct ibv_qp_attr attr = { .qp_state = IBV_QPS_INIT, .port_num = 1 };
	int mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT;
	if (type == IBV_QPT_UD) {
		attr.qkey = QKEY;
		mask |= IBV_QP_QKEY;
	} else {
		attr.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
				       IBV_ACCESS_REMOTE_ATOMIC;
		mask |= IBV_QP_ACCESS_FLAGS;
	}
	CHECK(!ibv_modify_qp(qp, &attr, mask), "QP to INIT");
	return qp;
}

static struct ibv_ah_attr route_to_peer(struct side *s)
{
	struct ibv_ah_attr ah = {
		.is_global = 1, .port_num = 1,
		.grh = { .dgid = s->peer_gid, .sgid_index = s->gid_index, .hop_limit = 64 },
	};
	return ah;
}

static void ud_to_rts(struct side *s)
{
	struct ibv_qp_attr attr = { .qp_state = IBV_QPS_RTR };
	CHECK(!ibv_modify_qp(s->ud, &attr, IBV_QP_STATE), "UD QP to RTR");
	attr.qp_state = IBV_QPS_RTS;
	attr.sq_psn = 0;
	CHECK(!ibv_modify_qp(s->ud, &attr, IBV_QP_STATE | IBV_QP_SQ_PSN), "UD QP to RTS");
}

static void rc_to_rts(struct side *s, uint32_t psn)
{
	struct ibv_qp_attr attr = {
		.qp_state = IBV_QPS_RTR, .path_mtu = s->mtu, .dest_qp_num = s->peer_rc_qpn,
		.rq_psn = s->peer_psn, .max_dest_rd_atomic = 1, .min_rnr_timer = 12,
		.ah_attr = route_to_peer(s),
	};
	CHECK(!ibv_modify_qp(s->rc, &attr,
			     IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
				     IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
				     IBV_QP_MIN_RNR_TIMER),
	      "RC QP to RTR towards the peer's GID");
	attr.qp_state = IBV_QPS_RTS;
	/* About 0.4 s of retries (rxe takes a retry count of 7 to mean "for ever"). */
	attr.timeout = 14;
	attr.retry_cnt = 6;
	attr.rnr_retry = 7;
	attr.sq_psn = psn;
	attr.max_rd_atomic = 1;
	CHECK(!ibv_modify_qp(s->rc, &attr,
			     IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
				     IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC),
	      "RC QP to RTS");
}

/* A fresh RC QP with its receives posted, connected to the peer's through the exchange. */
static void connect_rc(struct side *s)
{
	uint32_t psn = (uint32_t)(now_ms()) & 0xffffff;
	char line[256];
	if (s->rc)
		CHECK(!ibv_destroy_qp(s->rc), "ibv_destroy_qp");
	s->gid_index = find_gid_index(s);
	s->rc = create_qp(s, IBV_QPT_RC);
	for (int i = 0; i < RECV_SLOTS; i++)
		post_recv(s, s->rc, WR_RECV + i, RECV_AREA + i * MSG_LEN, MSG_LEN);
	tcp_send(s, "%u %u %u %u %lu", s->rc->qp_num, s->ud->qp_num, psn, s->mr->rkey,
		 (unsigned long)(uintptr_t)s->buf);
	tcp_receive(s, line, sizeof(line));
	unsigned long addr;
	CHECK(sscanf(line, "%u %u %u %u %lu", &s->peer_rc_qpn, &s->peer_ud_qpn, &s->peer_psn,
		     &s->peer_rkey, &addr) == 5,
	      "the peer's address line '%s'", line);
	s->peer_addr = addr;
	rc_to_rts(s, psn);
	/* Both sides in RTS before either sends. */
	tcp_send(s, "rts");
	tcp_expect(s, "rts");
}

/* ---- the checks ---- */

static void check_send_recv(struct side *s)
{
	enum { COUNT = 4 };
	if (!s->server) {
		struct ibv_wc wc;
		for (int i = 0; i < COUNT; i++) {
			fill(s->buf + SEND_AREA, MSG_LEN, 1 + i);
			struct ibv_send_wr wr = { .wr_id = WR_SEND, .opcode = IBV_WR_SEND };
			post_send(s, s->rc, &wr, SEND_AREA, MSG_LEN);
			if (i < COUNT - 1)
				await(s, WR_SEND);
		}
		/* The server replies once the last message arrives, which may be before this
		 * side sees the acknowledgement that completes its send: the two completions
		 * come in either order. */
		wc = await_either(s, WR_SEND, WR_RECV);
		if (wc.wr_id == WR_SEND)
			wc = await(s, WR_RECV);
		else
			await(s, WR_SEND);
		CHECK(wc.byte_len == MSG_LEN, "reply of %u bytes", wc.byte_len);
		expect_pattern(s->buf + RECV_AREA, MSG_LEN, 9, "the server's reply");
	} else {
		for (int i = 0; i < COUNT; i++) {
			struct ibv_wc wc = await(s, WR_RECV + i);
			CHECK(wc.byte_len == MSG_LEN, "message %d of %u bytes", i, wc.byte_len);
			CHECK(wc.opcode == IBV_WC_RECV, "a receive");
			expect_pattern(s->buf + RECV_AREA + i * MSG_LEN, MSG_LEN, 1 + i,
				       "a message from the client");
		}
		fill(s->buf + SEND_AREA, MSG_LEN, 9);
		struct ibv_send_wr wr = { .wr_id = WR_SEND, .opcode = IBV_WR_SEND };
		post_send(s, s->rc, &wr, SEND_AREA, MSG_LEN);
		await(s, WR_SEND);
	}
	printf("rdma_check: send/recv ok\n");
}

static void rdma(struct side *s, enum ibv_wr_opcode opcode, uint64_t local, uint64_t remote,
		 uint32_t len)
{
	struct ibv_send_wr wr = { .wr_id = WR_RDMA, .opcode = opcode };
	wr.wr.rdma.remote_addr = s->peer_addr + remote;
	wr.wr.rdma.rkey = s->peer_rkey;
	post_send(s, s->rc, &wr, local, len);
	await(s, WR_RDMA);
}

static void check_write(struct side *s)
{
	if (!s->server) {
		fill(s->buf + WRITE_AREA, RDMA_LEN, 21);
		rdma(s, IBV_WR_RDMA_WRITE, WRITE_AREA, WRITE_AREA, RDMA_LEN);
		tcp_send(s, "written");
		tcp_expect(s, "write-ok");
	} else {
		tcp_expect(s, "written");
		expect_pattern(s->buf + WRITE_AREA, RDMA_LEN, 21, "the client's RDMA WRITE");
		tcp_send(s, "write-ok");
	}
	printf("rdma_check: write ok\n");
}

static void check_read(struct side *s)
{
	if (!s->server) {
		rdma(s, IBV_WR_RDMA_READ, READ_AREA, READ_AREA, RDMA_LEN);
		expect_pattern(s->buf + READ_AREA, RDMA_LEN, 31, "what RDMA READ brought");
	}
	printf("rdma_check: read ok\n");
}

static uint64_t atomic(struct side *s, enum ibv_wr_opcode opcode, uint64_t add_or_compare,
		       uint64_t swap)
{
	struct ibv_send_wr wr = { .wr_id = WR_RDMA, .opcode = opcode };
	wr.wr.atomic.remote_addr = s->peer_addr + ATOMIC_AREA;
	wr.wr.atomic.rkey = s->peer_rkey;
	wr.wr.atomic.compare_add = add_or_compare;
	wr.wr.atomic.swap = swap;
	post_send(s, s->rc, &wr, ATOMIC_AREA, 8);
	await(s, WR_RDMA);
	uint64_t before;
	memcpy(&before, s->buf + ATOMIC_AREA, 8);
	return before;
}

static void check_atomics(struct side *s)
{
	if (!s->server) {
		CHECK(atomic(s, IBV_WR_ATOMIC_FETCH_AND_ADD, 5, 0) == 100, "first fetch-and-add");
		CHECK(atomic(s, IBV_WR_ATOMIC_FETCH_AND_ADD, 5, 0) == 105, "second fetch-and-add");
		CHECK(atomic(s, IBV_WR_ATOMIC_CMP_AND_SWP, 999, 1) == 110, "a failing compare");
		CHECK(atomic(s, IBV_WR_ATOMIC_CMP_AND_SWP, 110, 7) == 110, "compare-and-swap");
		tcp_send(s, "atomics-done");
		tcp_expect(s, "atomics-ok");
	} else {
		tcp_expect(s, "atomics-done");
		uint64_t value;
		memcpy(&value, s->buf + ATOMIC_AREA, 8);
		CHECK(value == 7, "the counter is %lu after the client's atomics, expected 7",
		      (unsigned long)value);
		tcp_send(s, "atomics-ok");
	}
	printf("rdma_check: atomics ok\n");
}

/* A UD datagram arrives from the peer's QP, with the peer's address as its source. */
static void receive_ud(struct side *s, int slot, int seed)
{
	struct ibv_wc wc = await(s, WR_UD_RECV + slot);
	const uint8_t *grh = s->buf + UD_RECV_AREA + slot * UD_SLOT;
	CHECK(wc.byte_len == GRH_LEN + UD_LEN, "a datagram of %u bytes", wc.byte_len);
	CHECK(wc.src_qp == s->peer_ud_qpn, "source QP %u, expected %u", wc.src_qp,
	      s->peer_ud_qpn);
	CHECK(wc.wc_flags & IBV_WC_GRH, "a GRH");
	/* RoCEv2 over IPv4: the last 20 bytes of the GRH area hold the IPv4 header. */
	uint32_t source;
	memcpy(&source, grh + 20 + 12, 4);
	char seen[INET_ADDRSTRLEN], expected[INET_ADDRSTRLEN];
	inet_ntop(AF_INET, &source, seen, sizeof(seen));
	inet_ntop(AF_INET, &s->peer_ip, expected, sizeof(expected));
	CHECK(source == s->peer_ip, "a datagram from %s, expected %s", seen, expected);
	expect_pattern(grh + GRH_LEN, UD_LEN, seed, "a datagram");
	printf("rdma_check: UD datagram from %s\n", seen);
}

static void send_ud(struct side *s, struct ibv_ah *ah, int seed)
{
	fill(s->buf + UD_SEND_AREA, UD_LEN, seed);
	struct ibv_send_wr wr = { .wr_id = WR_UD_SEND, .opcode = IBV_WR_SEND };
	wr.wr.ud.ah = ah;
	wr.wr.ud.remote_qpn = s->peer_ud_qpn;
	wr.wr.ud.remote_qkey = QKEY;
	post_send(s, s->ud, &wr, UD_SEND_AREA, UD_LEN);
	await(s, WR_UD_SEND);
}

static void check_ud(struct side *s)
{
	struct ibv_ah_attr route = route_to_peer(s);
	struct ibv_ah *ah = ibv_create_ah(s->pd, &route);
	CHECK(ah, "ibv_create_ah towards the peer's GID");
	if (!s->server) {
		send_ud(s, ah, 41);
		send_ud(s, ah, 42);
		receive_ud(s, 0, 43);
	} else {
		receive_ud(s, 0, 41);
		receive_ud(s, 1, 42);
		send_ud(s, ah, 43);
	}
	CHECK(!ibv_destroy_ah(ah), "ibv_destroy_ah");
	printf("rdma_check: ud ok\n");
}

/* The client streams WRITEs until they fail; the server pulls its link meanwhile. */
static void link_fault(struct side *s, const char *netdev)
{
	char command[128];
	if (s->server) {
		tcp_expect(s, "streaming");
		usleep(500000);
		snprintf(command, sizeof(command), "ip link set dev %s down", netdev);
		CHECK(!system(command), "%s", command);
		printf("rdma_check: %s down\n", netdev);
		fflush(stdout);
		sleep(3);
		snprintf(command, sizeof(command), "ip link set dev %s up", netdev);
		CHECK(!system(command), "%s", command);
		printf("rdma_check: %s up\n", netdev);
		tcp_send(s, "link-up");
		return;
	}
	tcp_send(s, "streaming");
	int outstanding = 0, written = 0, failed = 0;
	enum ibv_wc_status first_error = IBV_WC_SUCCESS;
	double start = now_ms();
	while (!failed || outstanding) {
		while (!failed && outstanding < 8) {
			struct ibv_send_wr wr = { .wr_id = WR_RDMA, .opcode = IBV_WR_RDMA_WRITE };
			wr.wr.rdma.remote_addr = s->peer_addr + WRITE_AREA;
			wr.wr.rdma.rkey = s->peer_rkey;
			post_send(s, s->rc, &wr, WRITE_AREA, RDMA_LEN);
			outstanding++;
		}
		struct ibv_wc wc;
		int got = ibv_poll_cq(s->cq, 1, &wc);
		CHECK(got >= 0, "ibv_poll_cq");
		CHECK(now_ms() - start < 2 * WAIT_MS, "the WRITEs end within %d ms (%d written)",
		      2 * WAIT_MS, written);
		if (!got || wc.wr_id != WR_RDMA)
			continue; /* receives are flushed too once the QP fails */
		outstanding--;
		if (wc.status == IBV_WC_SUCCESS) {
			written++;
		} else if (!failed) {
			failed = 1;
			first_error = wc.status;
		}
	}
	printf("rdma_check: link fault: %d WRITEs done, then %s\n", written,
	       ibv_wc_status_str(first_error));
	CHECK(first_error == IBV_WC_RETRY_EXC_ERR, "a retry-exceeded completion, got %s",
	      ibv_wc_status_str(first_error));
	tcp_expect(s, "link-up");
}

int main(int argc, char **argv)
{
	struct side s = { 0 };
	const char *device = NULL, *local = NULL, *peer = NULL, *netdev = NULL;
	int port = 0;
	CHECK(argc >= 2 && (!strcmp(argv[1], "server") || !strcmp(argv[1], "client")),
	      "usage: rdma_check server|client -d DEVICE --local IP --peer IP --port TCP "
	      "[--link-fault NETDEV]");
	s.server = !strcmp(argv[1], "server");
	CHECK(argc % 2 == 0, "options come in pairs");
	for (int i = 2; i + 1 < argc; i += 2) {
		if (!strcmp(argv[i], "-d"))
			device = argv[i + 1];
		else if (!strcmp(argv[i], "--local"))
			local = argv[i + 1];
		else if (!strcmp(argv[i], "--peer"))
			peer = argv[i + 1];
		else if (!strcmp(argv[i], "--port"))
			port = atoi(argv[i + 1]);
		else if (!strcmp(argv[i], "--link-fault"))
			netdev = argv[i + 1];
		else
			CHECK(0, "unknown option %s", argv[i]);
	}
	CHECK(device && local && peer && port > 0, "-d, --local, --peer and --port are required");
	CHECK(inet_pton(AF_INET, local, &s.local_ip) == 1, "--local %s", local);
	CHECK(inet_pton(AF_INET, peer, &s.peer_ip) == 1, "--peer %s", peer);
	gid_of_ip(s.local_ip, &s.local_gid);
	gid_of_ip(s.peer_ip, &s.peer_gid);
	setvbuf(stdout, NULL, _IOLBF, 0);

	struct ibv_device **list = ibv_get_device_list(NULL);
	CHECK(list, "ibv_get_device_list");
	for (struct ibv_device **d = list; *d && !s.ctx; d++)
		if (!strcmp(ibv_get_device_name(*d), device))
			s.ctx = ibv_open_device(*d);
	CHECK(s.ctx, "open %s", device);
	s.pd = ibv_alloc_pd(s.ctx);
	CHECK(s.pd, "ibv_alloc_pd");
	s.cq = ibv_create_cq(s.ctx, 64, NULL, NULL, 0);
	CHECK(s.cq, "ibv_create_cq");
	s.buf = aligned_alloc(4096, BUF_LEN);
	CHECK(s.buf, "buffer");
	memset(s.buf, 0, BUF_LEN);
	fill(s.buf + READ_AREA, RDMA_LEN, 31);
	uint64_t counter = 100;
	memcpy(s.buf + ATOMIC_AREA, &counter, 8);
	s.mr = ibv_reg_mr(s.pd, s.buf, BUF_LEN,
			  IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
				  IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC);
	CHECK(s.mr, "ibv_reg_mr");
	s.ud = create_qp(&s, IBV_QPT_UD);
	ud_to_rts(&s);
	for (int i = 0; i < UD_SLOTS; i++)
		post_recv(&s, s.ud, WR_UD_RECV + i, UD_RECV_AREA + i * UD_SLOT, GRH_LEN + UD_LEN);

	tcp_connect(&s, port);
	connect_rc(&s);
	printf("rdma_check: connected, GID index %d, peer QP %u\n", s.gid_index, s.peer_rc_qpn);
	if (netdev) {
		link_fault(&s, netdev);
		/* New QPs work once the link is back. */
		connect_rc(&s);
		check_send_recv(&s);
		check_write(&s);
	} else {
		check_send_recv(&s);
		check_write(&s);
		check_read(&s);
		check_atomics(&s);
		check_ud(&s);
	}
	tcp_send(&s, "done");
	tcp_expect(&s, "done");
	CHECK(!ibv_destroy_qp(s.rc) && !ibv_destroy_qp(s.ud), "ibv_destroy_qp");
	CHECK(!ibv_dereg_mr(s.mr), "ibv_dereg_mr");
	CHECK(!ibv_destroy_cq(s.cq), "ibv_destroy_cq");
	CHECK(!ibv_dealloc_pd(s.pd), "ibv_dealloc_pd");
	CHECK(!ibv_close_device(s.ctx), "ibv_close_device");
	ibv_free_device_list(list);
	printf("rdma_check: ok\n");
	return 0;
}
