/* SPDX-License-Identifier: GPL-2.0 OR BSD-3-Clause */
/*
 * vrdma_pin: the interface of /dev/vrdma-pin, through which a process in a VM pins its own
 * memory for the vrdma device and learns the memory's guest-physical addresses, as uverbs
 * pins registered memory (pin_user_pages with FOLL_LONGTERM, charged to RLIMIT_MEMLOCK).
 * guest-lib's pin.rs mirrors these structures; SPEC.md section 12 says why a driver needs them.
 */
#ifndef VRDMA_PIN_H
#define VRDMA_PIN_H

#include <linux/ioctl.h>
#include <linux/types.h>

/* VRDMA_PIN_IOC_PIN: pin the caller's pages addr .. addr + length (both page-aligned) and
 * write the physical address of each page, in order, to the array at `frames` (length /
 * page size entries of 8 bytes). The pages stay in their frames, and the frames allocated,
 * until the pin is ended (VRDMA_PIN_IOC_UNPIN, or the last close of the file: see
 * VRDMA_PIN_IOC_DEVICE for when that is later), whatever the process does to its mappings
 * or files meanwhile. Charged to the pinning process's RLIMIT_MEMLOCK (ENOMEM past it,
 * unless CAP_IPC_LOCK). Only the process that opened the file may pin through it (EPERM). */
struct vrdma_pin {
	__u64 addr;
	__u64 length;
	__u64 frames;
	__u32 id;	/* out: names the pin on this file */
	__u32 flags;	/* in: 0 */
};

#define VRDMA_PIN_IOC_PIN _IOWR('v', 1, struct vrdma_pin)
/* VRDMA_PIN_IOC_UNPIN: ends the pin `id` (a __u32) of this file, at once. */
#define VRDMA_PIN_IOC_UNPIN _IOW('v', 2, __u32)

/* VRDMA_PIN_IOC_DEVICE: names the device (a __u64 other than 0 its driver chooses, once per
 * file) for which this file's pins are made. Pins of such a file are not ended when it is
 * closed with them (its process died, say): the device may still be writing them, and they
 * are held until a driver of the same device says it has reset it. Needs CAP_SYS_ADMIN
 * (EPERM); EBUSY if the file names a device already. */
#define VRDMA_PIN_IOC_DEVICE _IOW('v', 3, __u64)
/* VRDMA_PIN_IOC_DEVICE_RESET: the device this file names was reset; nothing of the drivers
 * before reaches their pins any more, and those held for it end. Needs CAP_SYS_ADMIN (EPERM);
 * EINVAL if the file names no device. The module's parameter held_pages counts the pages
 * held. */
#define VRDMA_PIN_IOC_DEVICE_RESET _IO('v', 4)

/* Most bytes one pin may cover: 16 GiB. */
#define VRDMA_PIN_MAX_LENGTH (16ULL << 30)

#endif
