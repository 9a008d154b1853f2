"""Everything that runs ON a node: node operations, the launcher, the agent, the coordinator.

Standard library only (tests/test_node_stdlib.py imports it with site-packages
blocked): a node needs nothing installed but Python 3 for fabtrain itself.
"""
