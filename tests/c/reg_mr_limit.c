/* Registers memory until a limit refuses it, as a program pinning its buffers does. Written
 * against libibverbs only; tests/tests/guest_service_rxe.rs runs it on vrdma0 through
 * vrdma-run and the guest service under a chosen RLIMIT_MEMLOCK.
 * usage: reg_mr_limit DEVICE MIB...
 * Registers a fresh buffer of each MIB mebibytes in turn (all stay registered), printing
 * "MIB: ok" or "MIB: errno N" (ibv_reg_mr's errno: 12 is ENOMEM); exits 0 either way, 1 when
 * something else fails. */
#include "checks.h"
#include <sys/mman.h>

int main(int argc, char **argv)
{
	if (argc < 3) {
		fprintf(stderr, "usage: reg_mr_limit DEVICE MIB...\n");
		return 2;
	}
	struct ibv_context *context = open_device_named(argv[1]);
	struct ibv_pd *pd = ibv_alloc_pd(context);
	CHECK(pd, "ibv_alloc_pd");
	for (int i = 2; i < argc; i++) {
		size_t bytes = (size_t)atoi(argv[i]) << 20;
		void *buffer = mmap(NULL, bytes, PROT_READ | PROT_WRITE,
				    MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		CHECK(buffer != MAP_FAILED, "mmap");
		memset(buffer, i, bytes);
		errno = 0;
		struct ibv_mr *mr = ibv_reg_mr(pd, buffer, bytes, IBV_ACCESS_LOCAL_WRITE);
		if (mr)
			printf("%s: ok\n", argv[i]);
		else
			printf("%s: errno %d\n", argv[i], errno);
		fflush(stdout);
	}
	return 0;
}
