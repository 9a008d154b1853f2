"""fabtrain's node runtime, installed on the node by the node itself.

The agent runs from <workspace>/runtime/<version>/ (fabtrain/__init__.py,
fabtrain/contract/ and fabtrain/node/), apart from the user's code. `fab deploy` ships it with rsync,
but a start must not depend on that: a job never runs without its agents. Node
ops already hold every file of the runtime -- the controller sends them with
each call (fabtrain.remote.rpc), and <version> is a hash of exactly those files
(fabtrain.plan.runtime) -- so a start writes whatever is missing or differs
from what it was sent. A folder that already matches is left as it is (a
running agent's files are never rewritten under it), and one that a start
made whole is marked so (INSTALLED): the next start does not unpack the sent
sources at all to compare them.
"""
import os

import fabtrain
from fabtrain.contract import RUNTIME_PACKAGES
from fabtrain.node import atomic


def sources():
    """{path relative to the folder that holds fabtrain/: source} of every runtime file."""
    sent = getattr(fabtrain, "__sent__", None)  # rpc's bootstrap: (module name, (is_package, source)) items
    if sent is not None:
        out = {}
        for name, (is_package, source) in sent.items():
            if name == "fabtrain" or name.split(".")[1] in RUNTIME_PACKAGES:
                out[name.replace(".", "/") + ("/__init__.py" if is_package else ".py")] = source
        return out
    # Not sent (node code run from a deployed copy, or in-process): the files beside this one.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    files = [os.path.join(root, "fabtrain", "__init__.py")]
    for package in RUNTIME_PACKAGES:
        for folder, dirs, names in os.walk(os.path.join(root, "fabtrain", package)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            files += [os.path.join(folder, n) for n in sorted(names) if n.endswith(".py")]
    out = {}
    for path in files:
        with open(path) as f:
            out[os.path.relpath(path, root)] = f.read()
    return out


INSTALLED = ".installed"  # in <workspace>/runtime/<version>/: written last, once every file there is as sent


def install(target):
    """Make target (<workspace>/runtime/<version>) hold the runtime; returns how many files were written.

    A folder with INSTALLED in it is taken as it is: a start made it whole, and its name is the hash
    of its files. One without (new, or shipped by `fab deploy`, whose rsync may have stopped half
    way) has every file compared with what was sent."""
    if os.path.exists(os.path.join(target, INSTALLED)):
        return 0
    written = 0
    for rel, source in sorted(sources().items()):
        path = os.path.join(target, rel)
        try:
            with open(path) as f:
                if f.read() == source:
                    continue
        except (OSError, UnicodeDecodeError):
            pass  # missing or unreadable: written below
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        atomic.write(path, source)
        written += 1
    atomic.write(os.path.join(target, INSTALLED), "")
    return written
