"""``hixl.vllm``: hixl inside vLLM.

``HixlConnector`` is a vLLM KV connector (``KVConnectorBase_V1``) for prefill/decode disaggregation: it
registers vLLM's own KV cache tensors with a hixl engine (zero copy, in place) and moves a request's
prompt KV from the prefill instance's blocks into the decode instance's blocks with one-sided writes
(rdma; shm or tcp where there is none), layer by layer during the prefill's forward pass (``mode``
"push", the default) or by reads after it ("pull").

    vllm serve MODEL --kv-transfer-config \\
      '{"kv_connector":"HixlConnector","kv_connector_module_path":"hixl.vllm","kv_role":"kv_producer"}'

``hixl proxy`` routes OpenAI requests to the prefill and decode instances (:mod:`hixl.proxy`).
Needs vLLM: ``pip install 'hixl[vllm]'`` (or ``bash ci/install-vllm.sh VENV``).
"""
from __future__ import annotations

from .._extras import hint

try:
    import vllm  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(f"hixl.vllm needs vLLM ({e}); install it with: {hint('vllm')} "
                      "(on a CPU machine: bash ci/install-vllm.sh VENV)") from e

from .config import ConnectorConfig  # noqa: E402
from .connector import HixlConnector  # noqa: E402

__all__ = ["HixlConnector", "ConnectorConfig"]
