#!/usr/bin/env python3
"""Prints the libvirt domain tests/vm/run.sh --libvirt starts: backend/libvirt/vrdma-vm.xml,
the documented domain, made into the test guest's. Its name, memory, vCPUs, emulator and
vrdma socket are replaced; the domain type becomes qemu (TCG: the test machines have no KVM); the
guest is not restarted when it reboots; the disk gives way to the harness's kernel, initramfs and kernel command line, the machine's root
and the run folder shared over 9p (as run.sh gives them to QEMU itself), and the serial
console goes to a file.

usage: libvirt-domain.py TEMPLATE NAME MEMORY_MIB CPUS EMULATOR SOCKET QUEUES KERNEL INITRD
                         CMDLINE RUN_DIR CONSOLE_FILE
"""
import re
import sys
import xml.etree.ElementTree as ET

QEMU_NS = "http://libvirt.org/schemas/domain/qemu/1.0"


def main(template, name, memory_mib, cpus, emulator, socket, queues, kernel, initrd, cmdline,
         run_dir, console):
    ET.register_namespace("qemu", QEMU_NS)
    domain = ET.parse(template).getroot()
    domain.set("type", "qemu")
    domain.find("name").text = name
    memory = domain.find("memory")
    memory.set("unit", "MiB")
    memory.text = memory_mib
    domain.find("vcpu").text = cpus
    # A guest that panics reboots (panic=-1): the harness wants it ended, as QEMU's -no-reboot.
    domain.find("on_reboot").text = "destroy"

    os_element = domain.find("os")
    for boot in os_element.findall("boot"):
        os_element.remove(boot)
    for tag, text in (("kernel", kernel), ("initrd", initrd), ("cmdline", cmdline)):
        ET.SubElement(os_element, tag).text = text

    devices = domain.find("devices")
    devices.find("emulator").text = emulator
    for tag in ("disk", "serial", "console"):
        for element in devices.findall(tag):
            devices.remove(element)
    for source, target, readonly in (("/", "hostroot", True), (run_dir, "results", False)):
        share = ET.SubElement(devices, "filesystem", type="mount", accessmode="passthrough")
        ET.SubElement(share, "source", dir=source)
        ET.SubElement(share, "target", dir=target)
        if readonly:
            ET.SubElement(share, "readonly")
    serial = ET.SubElement(devices, "serial", type="file")
    ET.SubElement(serial, "source", path=console)

    arguments = domain.find(f"{{{QEMU_NS}}}commandline")
    replaced = 0
    for argument in arguments:
        value = argument.get("value")
        if value.startswith("socket,id=vrdma0,"):
            argument.set("value", re.sub(r"path=[^,]*", f"path={socket}", value))
            replaced += 1
        elif value.startswith("vhost-user-device-pci,"):
            argument.set("value", re.sub(r"num_vqs=[0-9]+", f"num_vqs={queues}", value))
            replaced += 1
    if replaced != 2:
        sys.exit(f"libvirt-domain.py: {template} lacks the vrdma chardev or device argument")
    ET.indent(domain)
    ET.ElementTree(domain).write(sys.stdout, encoding="unicode")
    print()


if __name__ == "__main__":
    if len(sys.argv) != 13:
        sys.exit(__doc__)
    main(*sys.argv[1:])
