"""fabtrain's orchestration library: everything behind the `fab` tasks.

Importable and testable without `fab`: the tasks in ../fabfile.py only parse
flags and call into here.
"""
