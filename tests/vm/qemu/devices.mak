# The devices the vrdma test VMs need of the patched QEMU (tests/vm/qemu/build.sh passes this
# file with --without-default-devices: 1343 build steps instead of 1593, a fifth less build
# time than with every x86 device). Kconfig
# adds what these select: the pc machine's chipset, IDE, PS/2, ISA serial, RTC, ACPI, fw_cfg.
# The pc machine (i440fx), which the VMs run directly (tests/vm/run.sh) and under libvirt.
CONFIG_I440FX=y
# virtio over PCI: the generic vhost-user device (vhost-user-device-pci, which vrdma is), the
# 9p shares of the machine's root and the run folder, and a NIC for run.sh --host-net.
CONFIG_VIRTIO_PCI=y
CONFIG_VIRTIO_9P=y
CONFIG_VIRTIO_NET=y
# What the pc machine's board code makes when QEMU is not given -nodefaults (run.sh): the
# standard VGA, the parallel port, the floppy controller; and the HPET it offers.
CONFIG_VGA_PCI=y
CONFIG_PARALLEL=y
CONFIG_FDC_ISA=y
CONFIG_HPET=y
