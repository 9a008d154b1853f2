"""The controller: the `fab` tasks' library (lifecycle, data copy, state, collector, reports).

Runs where `fab` runs. Reaches the nodes only through fabtrain.remote.
"""
