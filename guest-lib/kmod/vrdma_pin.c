// SPDX-License-Identifier: GPL-2.0 OR BSD-3-Clause
/*
 * vrdma_pin: pins a process's memory for the vrdma device in a VM, as uverbs pins registered
 * memory. The device is given guest-physical addresses; mlock() keeps a page resident but not
 * in its frame (compaction, NUMA balancing and THP collapse move locked pages) nor its frame
 * allocated (a hole punched in a memfd frees it). A pin keeps both until it ends, so what the
 * device writes always lands in memory the process still owns, and never in a frame the
 * kernel gave to someone else. The interface is in vrdma_pin.h.
 *
 * A driver that dies leaves its objects on the device, which goes on writing their memory
 * until the next driver resets it (SPEC.md section 9). So the pins of a file that names its
 * device are not ended when the file is closed: they are held until a driver of that device
 * says it has reset it.
 */
#include <linux/capability.h>
#include <linux/fs.h>
#include <linux/miscdevice.h>
#include <linux/mm.h>
#include <linux/module.h>
#include <linux/sched/mm.h>
#include <linux/sched/signal.h>
#include <linux/slab.h>
#include <linux/uaccess.h>
#include <linux/xarray.h>

#include "vrdma_pin.h"

/* One pin: its pages, held with FOLL_PIN until it ends. */
struct vrdma_pinned {
	struct page **pages;
	unsigned long npages;
};

/* An open file: the pins made through it, charged to the memory of the process that opened it. */
struct vrdma_pin_file {
	struct mm_struct *mm;
	struct xarray pins;
	/* The device the pins are for (VRDMA_PIN_IOC_DEVICE), 0 if none was named. */
	u64 device;
	/* Once closed with pins for a device: on vrdma_pin_held, with their page count. */
	struct list_head held;
	unsigned long held_pages;
};

/* Closed files whose device may still write their pinned pages. */
static LIST_HEAD(vrdma_pin_held);
static DEFINE_MUTEX(vrdma_pin_held_lock);
static unsigned long held_pages;
module_param(held_pages, ulong, 0444);
MODULE_PARM_DESC(held_pages, "pages of closed files held until their device is reset");

static int vrdma_pin_open(struct inode *inode, struct file *file)
{
	struct vrdma_pin_file *pf;

	if (!current->mm)
		return -EINVAL;
	pf = kzalloc(sizeof(*pf), GFP_KERNEL);
	if (!pf)
		return -ENOMEM;
	mmgrab(current->mm);
	pf->mm = current->mm;
	xa_init_flags(&pf->pins, XA_FLAGS_ALLOC1);
	file->private_data = pf;
	return 0;
}

static void vrdma_pin_end(struct vrdma_pin_file *pf, struct vrdma_pinned *pinned)
{
	unpin_user_pages_dirty_lock(pinned->pages, pinned->npages, true);
	atomic64_sub(pinned->npages, &pf->mm->pinned_vm);
	kvfree(pinned->pages);
	kfree(pinned);
}

/* Ends every pin of a file no one can use any more, and the file. */
static void vrdma_pin_file_end(struct vrdma_pin_file *pf)
{
	struct vrdma_pinned *pinned;
	unsigned long id;

	xa_for_each(&pf->pins, id, pinned)
		vrdma_pin_end(pf, pinned);
	xa_destroy(&pf->pins);
	mmdrop(pf->mm);
	kfree(pf);
}

static int vrdma_pin_release(struct inode *inode, struct file *file)
{
	struct vrdma_pin_file *pf = file->private_data;
	struct vrdma_pinned *pinned;
	unsigned long id;

	if (!pf->device || xa_empty(&pf->pins)) {
		vrdma_pin_file_end(pf);
		return 0;
	}
	/* No ioctl runs on a file being released: its pins are all there is. */
	xa_for_each(&pf->pins, id, pinned)
		pf->held_pages += pinned->npages;
	mutex_lock(&vrdma_pin_held_lock);
	list_add_tail(&pf->held, &vrdma_pin_held);
	held_pages += pf->held_pages;
	mutex_unlock(&vrdma_pin_held_lock);
	return 0;
}

/* Ends what closed files held for `device`, which its driver has reset. */
static void vrdma_pin_end_held(u64 device)
{
	struct vrdma_pin_file *pf, *next;
	LIST_HEAD(ending);

	mutex_lock(&vrdma_pin_held_lock);
	list_for_each_entry_safe(pf, next, &vrdma_pin_held, held) {
		if (pf->device != device)
			continue;
		list_move_tail(&pf->held, &ending);
		held_pages -= pf->held_pages;
	}
	mutex_unlock(&vrdma_pin_held_lock);
	list_for_each_entry_safe(pf, next, &ending, held)
		vrdma_pin_file_end(pf);
}

/* Charges `npages` to the file's process as uverbs does (mm->pinned_vm against RLIMIT_MEMLOCK). */
static int vrdma_pin_charge(struct vrdma_pin_file *pf, unsigned long npages)
{
	unsigned long limit = rlimit(RLIMIT_MEMLOCK) >> PAGE_SHIFT;
	s64 pinned = atomic64_add_return(npages, &pf->mm->pinned_vm);

	if ((u64)pinned > limit && !capable(CAP_IPC_LOCK)) {
		atomic64_sub(npages, &pf->mm->pinned_vm);
		return -ENOMEM;
	}
	return 0;
}

/* Writes the physical address of each page to the user array at `frames`. */
static int vrdma_pin_frames(struct vrdma_pinned *pinned, u64 frames)
{
	u64 chunk[64];
	unsigned long done = 0;

	while (done < pinned->npages) {
		unsigned long n = min_t(unsigned long, ARRAY_SIZE(chunk), pinned->npages - done);
		unsigned long i;

		for (i = 0; i < n; i++)
			chunk[i] = (u64)page_to_pfn(pinned->pages[done + i]) << PAGE_SHIFT;
		if (copy_to_user(u64_to_user_ptr(frames + done * sizeof(u64)), chunk,
				 n * sizeof(u64)))
			return -EFAULT;
		done += n;
	}
	return 0;
}

static long vrdma_pin_pin(struct vrdma_pin_file *pf, struct vrdma_pin __user *arg)
{
	struct vrdma_pin request;
	struct vrdma_pinned *pinned;
	unsigned long npages, done = 0;
	u32 id;
	int err;

	if (copy_from_user(&request, arg, sizeof(request)))
		return -EFAULT;
	if (request.flags || !request.length || request.length > VRDMA_PIN_MAX_LENGTH ||
	    !PAGE_ALIGNED(request.addr) || !PAGE_ALIGNED(request.length) ||
	    request.addr + request.length < request.addr)
		return -EINVAL;
	npages = request.length >> PAGE_SHIFT;
	err = vrdma_pin_charge(pf, npages);
	if (err)
		return err;
	err = -ENOMEM;
	pinned = kzalloc(sizeof(*pinned), GFP_KERNEL);
	if (!pinned)
		goto uncharge;
	pinned->pages = kvmalloc_array(npages, sizeof(*pinned->pages), GFP_KERNEL);
	if (!pinned->pages)
		goto free_pinned;
	while (done < npages) {
		long got = pin_user_pages_fast(request.addr + done * PAGE_SIZE, npages - done,
					       FOLL_WRITE | FOLL_LONGTERM, pinned->pages + done);

		if (got <= 0) {
			err = got ? got : -EFAULT;
			goto unpin;
		}
		done += got;
		if (fatal_signal_pending(current)) {
			err = -EINTR;
			goto unpin;
		}
	}
	pinned->npages = npages;
	err = vrdma_pin_frames(pinned, request.frames);
	if (err)
		goto unpin;
	err = xa_alloc(&pf->pins, &id, pinned, xa_limit_32b, GFP_KERNEL);
	if (err)
		goto unpin;
	if (put_user(id, &arg->id)) {
		xa_erase(&pf->pins, id);
		err = -EFAULT;
		goto unpin;
	}
	return 0;

unpin:
	unpin_user_pages(pinned->pages, done);
	kvfree(pinned->pages);
free_pinned:
	kfree(pinned);
uncharge:
	atomic64_sub(npages, &pf->mm->pinned_vm);
	return err;
}

static long vrdma_pin_ioctl(struct file *file, unsigned int cmd, unsigned long arg)
{
	struct vrdma_pin_file *pf = file->private_data;
	struct vrdma_pinned *pinned;
	u64 device;
	u32 id;

	/* Pins are charged to, and made in, the memory of the process that opened the file. */
	if (current->mm != pf->mm)
		return -EPERM;
	switch (cmd) {
	case VRDMA_PIN_IOC_DEVICE:
		/* Only a device's driver may have pages held past its end, or end them. */
		if (!capable(CAP_SYS_ADMIN))
			return -EPERM;
		if (get_user(device, (u64 __user *)arg))
			return -EFAULT;
		if (!device)
			return -EINVAL;
		if (cmpxchg(&pf->device, 0, device))
			return -EBUSY;
		return 0;
	case VRDMA_PIN_IOC_DEVICE_RESET:
		if (!capable(CAP_SYS_ADMIN))
			return -EPERM;
		if (!pf->device)
			return -EINVAL;
		vrdma_pin_end_held(pf->device);
		return 0;
	case VRDMA_PIN_IOC_PIN:
		return vrdma_pin_pin(pf, (struct vrdma_pin __user *)arg);
	case VRDMA_PIN_IOC_UNPIN:
		if (get_user(id, (u32 __user *)arg))
			return -EFAULT;
		pinned = xa_erase(&pf->pins, id);
		if (!pinned)
			return -ENOENT;
		vrdma_pin_end(pf, pinned);
		return 0;
	default:
		return -ENOTTY;
	}
}

static const struct file_operations vrdma_pin_fops = {
	.owner = THIS_MODULE,
	.open = vrdma_pin_open,
	.release = vrdma_pin_release,
	.unlocked_ioctl = vrdma_pin_ioctl,
	.compat_ioctl = compat_ptr_ioctl,
};

static struct miscdevice vrdma_pin_device = {
	.minor = MISC_DYNAMIC_MINOR,
	.name = "vrdma-pin",
	/* Any process may pin its own memory, within its RLIMIT_MEMLOCK, as with uverbs. */
	.mode = 0666,
	.fops = &vrdma_pin_fops,
};

static int __init vrdma_pin_init(void)
{
	return misc_register(&vrdma_pin_device);
}

/* Unloading the module ends what it held: whoever unloads it knows no device uses it. */
static void __exit vrdma_pin_exit(void)
{
	struct vrdma_pin_file *pf, *next;

	misc_deregister(&vrdma_pin_device);
	list_for_each_entry_safe(pf, next, &vrdma_pin_held, held)
		vrdma_pin_file_end(pf);
}

module_init(vrdma_pin_init);
module_exit(vrdma_pin_exit);

MODULE_DESCRIPTION("Pins process memory for the vrdma paravirtual RDMA device");
MODULE_LICENSE("Dual BSD/GPL");
