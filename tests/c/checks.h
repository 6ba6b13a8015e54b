/* What the test programs of tests/c/ share: failing loudly at the first check that does not
 * hold, and connecting an RC QP to a QP of the same port. */
#ifndef VRDMA_TEST_CHECKS_H
#define VRDMA_TEST_CHECKS_H

#define _GNU_SOURCE
#include <errno.h>
#include <infiniband/verbs.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Exits 1, saying what failed (and errno's message), unless `cond` holds. */
#define CHECK(cond, what)                                                                  \
	do {                                                                               \
		if (!(cond)) {                                                             \
			perror(what);                                                      \
			fprintf(stderr, "%s: %s failed (line %d)\n",                       \
				program_invocation_short_name, what, __LINE__);            \
			exit(1);                                                           \
		}                                                                          \
	} while (0)

/* Opens the device called `name` (the list is freed: an open device stays usable). */
static inline struct ibv_context *open_device_named(const char *name)
{
	struct ibv_device **list = ibv_get_device_list(NULL);
	CHECK(list, "ibv_get_device_list");
	struct ibv_context *context = NULL;
	for (int i = 0; list[i] && !context; i++)
		if (!strcmp(ibv_get_device_name(list[i]), name))
			context = ibv_open_device(list[i]);
	ibv_free_device_list(list);
	CHECK(context, "ibv_open_device");
	return context;
}

/* Walks `qp` RESET -> INIT -> RTR -> RTS towards QP `remote_qpn` at `gid`, sending from GID
 * `gid_index` of port 1, with remote writes, reads and atomics allowed. */
static inline void connect_rc_qp(struct ibv_qp *qp, uint32_t remote_qpn, union ibv_gid *gid,
				 int gid_index)
{
	struct ibv_qp_attr attr = {
		.qp_state = IBV_QPS_INIT, .port_num = 1, .pkey_index = 0,
		.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
				   IBV_ACCESS_REMOTE_ATOMIC,
	};
	CHECK(!ibv_modify_qp(qp, &attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
					 IBV_QP_ACCESS_FLAGS), "modify to INIT");
	memset(&attr, 0, sizeof attr);
	attr.qp_state = IBV_QPS_RTR;
	attr.path_mtu = IBV_MTU_1024;
	attr.dest_qp_num = remote_qpn;
	attr.max_dest_rd_atomic = 1;
	attr.min_rnr_timer = 12;
	attr.ah_attr.is_global = 1;
	attr.ah_attr.grh.dgid = *gid;
	attr.ah_attr.grh.sgid_index = gid_index;
	attr.ah_attr.grh.hop_limit = 1;
	attr.ah_attr.port_num = 1;
	CHECK(!ibv_modify_qp(qp, &attr, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU |
					 IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
					 IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER),
	      "modify to RTR");
	memset(&attr, 0, sizeof attr);
	attr.qp_state = IBV_QPS_RTS;
	attr.timeout = 14;
	attr.retry_cnt = 7;
	attr.rnr_retry = 7;
	attr.max_rd_atomic = 1;
	CHECK(!ibv_modify_qp(qp, &attr, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
					 IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
					 IBV_QP_MAX_QP_RD_ATOMIC),
	      "modify to RTS");
}

#endif
