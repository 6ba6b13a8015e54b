/* What libfabric's verbs provider asks of librdmacm before it connects anything, and what a
 * program probing by trial gets: rdma_getaddrinfo with the addresses in its hints (no node,
 * no service), "localhost" and a bare service, results whose addresses the program replaces
 * with malloc(3)'s own for rdma_freeaddrinfo to free; then refused tries (a port space not
 * served, an id on a device without connection management, an unserved function), each
 * failing with an errno and no word on standard error (tests/tests/rdmacm_programs_rxe.rs
 * checks that, and that VRDMA_DEBUG=1 brings the words back).
 * Run on vrdma only (it hands an unserved function NULLs).
 * usage: cm_probe   prints "cm_probe: ok" at the end of a clean run. */
#include "cm_checks.h"

static struct sockaddr_in ipv4(const char *address, int port)
{
	struct sockaddr_in sin = { .sin_family = AF_INET, .sin_port = htons(port) };
	CHECK(inet_pton(AF_INET, address, &sin.sin_addr) == 1, "inet_pton");
	return sin;
}

/* `got` is the IPv4 address `address`:`port`. */
static void check_address(const struct sockaddr *got, const char *address, int port, const char *what)
{
	CHECK(got && got->sa_family == AF_INET, what);
	const struct sockaddr_in *sin = (const struct sockaddr_in *)got;
	struct sockaddr_in wanted = ipv4(address, port);
	CHECK(sin->sin_addr.s_addr == wanted.sin_addr.s_addr && sin->sin_port == wanted.sin_port,
	      what);
}

int main(void)
{
	/* No node, no service: the hints' addresses, as libfabric passes an endpoint's. */
	struct sockaddr_in dst = ipv4("192.0.2.7", 7471), src = ipv4("192.0.2.8", 0);
	struct rdma_addrinfo hints = {
		.ai_flags = 0,
		.ai_family = AF_INET,
		.ai_qp_type = IBV_QPT_RC,
		.ai_port_space = RDMA_PS_TCP,
		.ai_dst_addr = (struct sockaddr *)&dst,
		.ai_dst_len = sizeof(dst),
		.ai_src_addr = (struct sockaddr *)&src,
		.ai_src_len = sizeof(src),
	};
	struct rdma_addrinfo *res;
	CHECK(rdma_getaddrinfo(NULL, NULL, &hints, &res) == 0, "rdma_getaddrinfo (hints only)");
	check_address(res->ai_dst_addr, "192.0.2.7", 7471, "the hints' destination");
	check_address(res->ai_src_addr, "192.0.2.8", 0, "the hints' source");
	CHECK(res->ai_dst_addr != hints.ai_dst_addr, "a copy of the destination");
	CHECK(res->ai_port_space == RDMA_PS_TCP && res->ai_qp_type == IBV_QPT_RC, "the hints' kinds");
	rdma_freeaddrinfo(res);

	/* "localhost" for a passive side, as libfabric looks for the server's source address. */
	struct rdma_addrinfo passive = { .ai_flags = RAI_PASSIVE, .ai_family = AF_INET,
					 .ai_qp_type = IBV_QPT_RC, .ai_port_space = RDMA_PS_TCP };
	CHECK(rdma_getaddrinfo("localhost", NULL, &passive, &res) == 0, "rdma_getaddrinfo (localhost)");
	check_address(res->ai_src_addr, "127.0.0.1", 0, "localhost");
	CHECK(res->ai_dst_addr == NULL, "no destination for a passive side");
	rdma_freeaddrinfo(res);

	/* A service alone: the unspecified address passive, the loopback address active, as
	 * getaddrinfo(3) gives them; the active result's source is the program's to fill, with
	 * memory of its own that rdma_freeaddrinfo frees. */
	CHECK(rdma_getaddrinfo(NULL, "7472", &passive, &res) == 0, "rdma_getaddrinfo (passive)");
	check_address(res->ai_src_addr, "0.0.0.0", 7472, "a passive side's address");
	rdma_freeaddrinfo(res);
	struct rdma_addrinfo active = { .ai_family = AF_INET, .ai_port_space = RDMA_PS_TCP };
	CHECK(rdma_getaddrinfo(NULL, "7473", &active, &res) == 0, "rdma_getaddrinfo (active)");
	check_address(res->ai_dst_addr, "127.0.0.1", 7473, "an active side's address");
	CHECK(res->ai_src_addr == NULL, "no source for an active side");
	res->ai_src_addr = malloc(sizeof(src));
	CHECK(res->ai_src_addr, "malloc");
	memcpy(res->ai_src_addr, &src, sizeof(src));
	res->ai_src_len = sizeof(src);
	rdma_freeaddrinfo(res);

	CHECK(rdma_getaddrinfo(NULL, NULL, NULL, &res) == -1 && errno == EINVAL,
	      "rdma_getaddrinfo with nothing to go on");

	/* Refused tries, each with an errno and nothing said. */
	struct rdma_cm_id *id;
	for (int i = 0; i < 3; i++)
		CHECK(rdma_create_id(NULL, &id, NULL, RDMA_PS_IB) == -1 && errno == EINVAL,
		      "rdma_create_id in RDMA_PS_IB");
	for (int i = 0; i < 3; i++)
		CHECK(rdma_create_id(NULL, &id, NULL, RDMA_PS_TCP) == -1,
		      "rdma_create_id on a device without connection management");
	CHECK(rdma_join_multicast(NULL, NULL, NULL) == -1 && errno == ENOSYS, "rdma_join_multicast");
	printf("cm_probe: ok\n");
	return 0;
}
