"""Reliability: faults, hung or hostile peers, auth, soak; their shared peers and relays: helpers.py."""
