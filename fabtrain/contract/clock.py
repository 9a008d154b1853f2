"""Whether two machines share a clock: they do when they run the same kernel (the same boot id).

A node that shares the controller's kernel (a local node) reads the controller's very clock, so
`fab check` measures no offset for it however long the round trip took.
"""


def boot_id():
    """This kernel's boot id (None: unknown)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None
