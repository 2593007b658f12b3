"""The vLLM tier: HixlConnector inside vLLM itself (needs the environment ci/install-vllm.sh makes)."""
