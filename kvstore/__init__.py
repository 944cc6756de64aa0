"""Cluster state in Redis (registry, placement, prefix index) and KV-block transfer."""
