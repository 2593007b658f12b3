"""hixl's tests. Tier 1 (no device) at this level; rdma/ (the `rdma` marker), interop/ (a pyverbs peer),
reliability/ (faults and hostile peers), vllm_tier/ (vLLM itself). Markers and tiers: conftest.py."""
