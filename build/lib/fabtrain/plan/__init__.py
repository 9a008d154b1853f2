"""The plan: pure data saying what runs where, made from a Cluster (runs on the controller, touches nothing)."""
