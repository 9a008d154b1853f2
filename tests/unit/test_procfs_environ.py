"""procfs.environ reads a process's environment whole while it execs (a launcher's child becoming stdbuf, then
the program): never the start of one image's block without its end. A file object's read() took it in
two read(2) calls, 8 KiB first; a call after the exec read nothing more, and the program seemed to lack
its RANK (the election test, in a whole run of the suite here: MASTER_PORT there, RANK not)."""
import os
import subprocess

from fabtrain.node import procfs
from tests.support.procscan import wait_for

# A shell that execs itself again and again, every image with the same environment of about 20 KiB.
AGAIN = 'n=${1:-0}; [ "$n" -lt 2000 ] && exec /bin/sh -c "$0" "$0" $((n+1))'


def test_an_environment_read_while_its_process_execs_is_whole_or_empty_never_half():
    env = {"FIRST": "1", **{"PAD%d" % i: "x" * 100 for i in range(200)}, "LAST": "1", "PATH": os.environ["PATH"]}
    p = subprocess.Popen(["/bin/sh", "-c", AGAIN, AGAIN], env=env)
    reads, half = 0, []
    try:
        while p.poll() is None:
            seen = procfs.environ(p.pid)
            if seen:  # empty: between two images, or gone
                reads += 1
                if (b"FIRST" in seen) != (b"LAST" in seen):
                    half.append(sorted(seen)[:3])
    finally:
        p.kill()
        p.wait()
    assert reads > 100, reads  # it was read while it exec'd
    assert half == [], (len(half), reads, half[:3])


def test_an_environment_larger_than_one_read_is_read_to_its_end():
    env = {"FIRST": "1", **{"BIG%d" % i: "y" * 100_000 for i in range(3)}, "LAST": "1"}  # 300 KB: two reads
    p = subprocess.Popen(["/bin/sleep", "30"], env=env)
    try:
        seen = wait_for(lambda: procfs.environ(p.pid), timeout=10)  # empty until its exec has laid it out
    finally:
        p.kill()
        p.wait()
    assert seen == {k.encode(): v.encode() for k, v in env.items()}
