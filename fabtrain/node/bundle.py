"""Node ops as one program text, with the node modules it imports.

Node ops run by the node's own interpreter from a text sent with each
command, so they work before `fab deploy` (and after the code directory is
gone). They import the node side's shared parts (procfs, atomic, states,
launch, the supervisor's kill escalation); `source()` puts those modules'
texts in front of ops.py's, installed into ``sys.modules`` under their real
names, so ``from fabtrain.node import procfs`` works the same on the node as
here. ops.py's own text then runs in the caller's namespace, as before.
"""
from __future__ import annotations

import os

HERE = os.path.dirname(os.path.abspath(__file__))
# Dependency order: each module imports only those before it.
SHIPPED = ("states", "procfs", "atomic", "launch", "agent/supervisor")
PACKAGES = ("fabtrain", "fabtrain.node", "fabtrain.node.agent")

_INSTALL = '''\
import sys as _sys, types as _types
def _fabtrain_install(name, text, package=False):
    module = _types.ModuleType(name)
    module.__source__ = text
    module.__file__ = "<fabtrain bundle>/" + name
    if package:
        module.__path__ = []
    _sys.modules[name] = module
    parent, _, leaf = name.rpartition(".")
    if parent:
        setattr(_sys.modules[parent], leaf, module)
    exec(compile(text, module.__file__, "exec"), module.__dict__)
'''


def _read(rel: str) -> str:
    with open(os.path.join(HERE, rel)) as f:
        return f.read()


def source() -> str:
    parts = [_INSTALL]
    for name in PACKAGES:
        parts.append("_fabtrain_install(%r, '', True)\n" % name)
    for rel in SHIPPED:
        name = "fabtrain.node." + rel.replace("/", ".")
        parts.append("_fabtrain_install(%r, %r)\n" % (name, _read(rel + ".py")))
    parts.append(_read("ops.py"))
    return "".join(parts)
