/* Creates queues the way programs that size them by the device's limits do, and searches
 * limits by trial the way libfabric and UCX do:
 *   - a CQ at max_cqe and an RC QP with both queues at max_qp_wr (one SGE each) beside it;
 *   - UCX's UD QP (256 sends of 6 SGEs or 64 inline bytes, 4,096 receives of one SGE);
 *   - a QP deeper than max_qp_wr, which must be refused with an errno;
 *   - the largest inline size and SGE count a QP takes, found by halving from far above the
 *     device's limits: each refused try must fail with an errno and print nothing.
 * Prints "probe_limits: ok" and what it found; exits 1 at the first check that fails.
 *
 * usage: probe_limits DEVICE */
#include "checks.h"

static struct ibv_qp *create(struct ibv_pd *pd, struct ibv_cq *cq, enum ibv_qp_type type,
			     uint32_t send_wr, uint32_t recv_wr, uint32_t send_sge,
			     uint32_t inline_data)
{
	struct ibv_qp_init_attr init = {
		.send_cq = cq,
		.recv_cq = cq,
		.qp_type = type,
		.cap = {.max_send_wr = send_wr, .max_recv_wr = recv_wr, .max_send_sge = send_sge,
			.max_recv_sge = 1, .max_inline_data = inline_data},
	};
	errno = 0;
	return ibv_create_qp(pd, &init);
}

/* The largest value from `start` down (halving) for which `try` creates a QP. */
static uint32_t search(struct ibv_pd *pd, struct ibv_cq *cq, uint32_t start, int inline_search)
{
	for (uint32_t value = start; value > 0; value /= 2) {
		struct ibv_qp *qp = inline_search ? create(pd, cq, IBV_QPT_RC, 16, 16, 1, value)
						  : create(pd, cq, IBV_QPT_RC, 16, 16, value, 0);
		if (qp) {
			CHECK(!ibv_destroy_qp(qp), "ibv_destroy_qp");
			return value;
		}
		CHECK(errno != 0, "a refused ibv_create_qp sets errno");
	}
	return 0;
}

int main(int argc, char **argv)
{
	CHECK(argc == 2, "usage: probe_limits DEVICE");
	struct ibv_context *context = open_device_named(argv[1]);
	struct ibv_device_attr attr;
	CHECK(!ibv_query_device(context, &attr), "ibv_query_device");
	struct ibv_pd *pd = ibv_alloc_pd(context);
	CHECK(pd, "ibv_alloc_pd");
	struct ibv_cq *cq = ibv_create_cq(context, attr.max_cqe, NULL, NULL, 0);
	CHECK(cq, "ibv_create_cq at max_cqe");

	uint32_t depth = (uint32_t)attr.max_qp_wr;
	struct ibv_qp *deep = create(pd, cq, IBV_QPT_RC, depth, depth, 1, 0);
	CHECK(deep, "ibv_create_qp with both queues at max_qp_wr, beside a CQ at max_cqe");
	struct ibv_qp *ucx_ud = create(pd, cq, IBV_QPT_UD, 256, 4096, 6, 64);
	CHECK(ucx_ud, "ibv_create_qp of UCX's UD shape (4,096 receives)");

	struct ibv_qp *too_deep = create(pd, cq, IBV_QPT_RC, depth + 1, 16, 1, 0);
	CHECK(!too_deep, "ibv_create_qp deeper than max_qp_wr is refused");
	CHECK(errno == EINVAL || errno == ENOMEM, "a QP deeper than max_qp_wr: EINVAL or ENOMEM");

	uint32_t inline_data = search(pd, cq, 1 << 20, 1);
	uint32_t sges = search(pd, cq, 1 << 12, 0);
	CHECK(inline_data > 0 && sges > 0, "some inline size and SGE count are taken");
	CHECK(sges <= (uint32_t)attr.max_sge, "no more SGEs than max_sge are taken");

	CHECK(!ibv_destroy_qp(ucx_ud), "ibv_destroy_qp");
	CHECK(!ibv_destroy_qp(deep), "ibv_destroy_qp");
	CHECK(!ibv_destroy_cq(cq), "ibv_destroy_cq");
	CHECK(!ibv_dealloc_pd(pd), "ibv_dealloc_pd");
	CHECK(!ibv_close_device(context), "ibv_close_device");
	printf("probe_limits: ok: max_qp_wr %u, max_cqe %d, inline %u, SGEs %u\n", depth,
	       attr.max_cqe, inline_data, sges);
	return 0;
}
