"""Tier 2: the data path on a real RDMA device (rxe0 in the CI VM); peer_proc.py is the peer process."""
