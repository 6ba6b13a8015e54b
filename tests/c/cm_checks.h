/* What the rdma_cm test programs of tests/c/ share: the checks, and waiting for one event. */
#ifndef VRDMA_TEST_CM_CHECKS_H
#define VRDMA_TEST_CM_CHECKS_H

#include "checks.h"
#include <arpa/inet.h>
#include <rdma/rdma_cma.h>

/* The next event on `channel`, which must be `wanted`; acknowledged. Returns its id. */
static inline struct rdma_cm_id *expect_event(struct rdma_event_channel *channel,
					      enum rdma_cm_event_type wanted)
{
	struct rdma_cm_event *event;
	CHECK(rdma_get_cm_event(channel, &event) == 0, "rdma_get_cm_event");
	if (event->event != wanted) {
		fprintf(stderr, "%s: %s (status %d), expected %s\n", program_invocation_short_name,
			rdma_event_str(event->event), event->status, rdma_event_str(wanted));
		exit(1);
	}
	struct rdma_cm_id *id = event->id;
	CHECK(rdma_ack_cm_event(event) == 0, "rdma_ack_cm_event");
	return id;
}

#endif
