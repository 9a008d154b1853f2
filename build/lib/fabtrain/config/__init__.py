"""Configuration: cluster.yaml loaded, validated and frozen (runs on the controller)."""
