"""``HixlConnector``: vLLM's ``KVConnectorBase_V1`` over hixl, for both roles (a facade: the scheduler
side is :class:`~hixl.vllm.scheduler.HixlScheduler`, the worker side :class:`~hixl.vllm.worker.HixlWorker`).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Dict, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .config import ConnectorConfig
from .metadata import HixlConnectorMetadata
from .scheduler import HixlScheduler
from .specs import group_specs, latent_of
from .stats import HixlPromMetrics, HixlStats
from .worker import HixlWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

_log = logging.getLogger("hixl.vllm")


def _log_like_vllm() -> None:
    """hixl's loggers write where vLLM's do, at vLLM's level (VLLM_LOGGING_LEVEL), unless the
    application configured them itself."""
    ours, theirs = logging.getLogger("hixl"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for h in theirs.handlers:
        ours.addHandler(h)
    ours.setLevel(theirs.level or logging.INFO)
    ours.propagate = False


def _tp_rank(tp_size: int) -> tuple:
    """This worker's tensor-parallel (rank, size): vLLM's TP group once it is up (each rank's worker
    has an engine of its own, on ``port + rank``)."""
    if tp_size == 1:
        return 0, 1
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


class HixlConnector(KVConnectorBase_V1, SupportsHMA):
    """Prefill/decode disaggregation over hixl: layer-wise push (default) or pull, zero copy in place.

    ``--kv-transfer-config '{"kv_connector": "HixlConnector", "kv_connector_module_path": "hixl.vllm",
    "kv_role": "kv_producer"}'`` on prefill instances, ``"kv_consumer"`` on decode instances (or
    ``"kv_both"``); options in ``kv_connector_extra_config`` (see :mod:`hixl.vllm.config`). It supports
    vLLM's hybrid KV cache manager (``SupportsHMA``): every KV cache group moves (full attention, sliding
    window, MLA, Mamba state; :mod:`hixl.vllm.specs`)."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        _log_like_vllm()
        ktc = vllm_config.kv_transfer_config
        self.config = ConnectorConfig.parse(ktc.kv_connector_extra_config)
        pc = vllm_config.parallel_config
        if pc.pipeline_parallel_size != 1:
            raise NotImplementedError(f"HixlConnector does not support pipeline parallelism: pipeline_parallel_size "
                                      f"must be 1 (got {pc.pipeline_parallel_size}); tensor parallelism is supported")
        if kv_cache_config is None:
            raise NotImplementedError("HixlConnector needs vLLM's KV cache config")
        mc = vllm_config.model_config
        self.specs = group_specs(kv_cache_config, mc.get_total_num_kv_heads(),
                                 getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto"),
                                 latent_of(getattr(mc, "hf_text_config", None)))
        self.kv_role = ktc.kv_role
        self._scheduler: Optional[HixlScheduler] = None
        self._worker: Optional[HixlWorker] = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = HixlScheduler(self.config, self.specs, self.kv_role, engine_id=str(ktc.engine_id),
                                            dp_rank=pc.data_parallel_rank)
            self._scheduler.serve_bootstrap()  # prefill roles: GET /query on bootstrap_port (0: none)
        else:
            rank, tp = _tp_rank(pc.tensor_parallel_size)
            self._worker = HixlWorker(self.config, self.kv_role, ktc.engine_id, kv_cache_config.num_blocks,
                                      self.specs, rank=rank, tp_size=tp)

    # -- worker side --------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self):
        return self._worker.handshake() if self._worker is not None else None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, HixlConnectorMetadata):
            self._worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return  # loads start in bind_connector_metadata (before the forward) and complete asynchronously

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a request runs only once its KV is complete

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set) -> tuple:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending, r.finished_recving

    def get_transfer_results(self, finished_req_ids: set) -> KVConnectorTransferResults:
        sending, recving, failed = self._worker.transfer_results(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_kv_connector_stats(self) -> Optional[HixlStats]:
        return self._worker.stats.take() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.close()

    # -- scheduler side -----------------------------------------------------------------------------
    def set_xfer_handshake_metadata(self, metadata: Dict[int, Any]) -> None:
        self._scheduler.set_handshake(metadata)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: Any, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: "Request", block_ids: list) -> tuple:
        return self._scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: "Request", block_ids: tuple) -> tuple:
        return self._scheduler.request_finished(request, block_ids)

    def on_new_request(self, request: "Request") -> None:
        self._scheduler.on_new_request(request)

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._scheduler is not None:
            self._scheduler.kv_cache_manager = kv_cache_manager

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> tuple:
        """A load restores every group that moves (vLLM must not zero their blocks meanwhile)."""
        return tuple(s.index for s in self.specs)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler.update_connector_output(connector_output)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    # -- class-level hooks --------------------------------------------------------------------------
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> Optional[str]:
        return None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: Dict[str, Any]) -> bool:
        return True  # save_kv_layer runs between the layers

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None) -> HixlStats:
        return HixlStats(data=data) if data is not None else HixlStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: Dict[type, type], labelnames: list,
                           per_engine_labelvalues: Dict[int, list]) -> HixlPromMetrics:
        return HixlPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
