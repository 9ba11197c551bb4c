"""Assembling one replica's service: engine core over an executor, async engine, HTTP app, publisher.

Shared by `pagedserve scheduler` (remote engine, Redis registry) and `pagedserve serve` (in-process
engine, in-memory registry), so both run the same code path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import FastAPI

from services.contracts.internal_auth import InternalToken
from services.model_files.tokenizer import ModelTokenizer
from services.registry.model import RegistrySink, ReplicaInfo
from services.registry.publisher import ReplicaPublisher
from services.replica.app import create_replica_app
from services.replica.lora_admin import LoraAdmin
from services.replica.lora_demand import DEFAULT_MAX_ADAPTERS, OnDemandLoader
from services.replica.metrics import SchedulerMetrics
from services.replica.openai_serving import OpenAIServing, ServingConfig
from services.replica.replica_state import Replica


@dataclass
class ReplicaSettings:
    served_model_name: str | None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    max_waiting: int | None = None  # None: services.scheduler.async_scheduler.default_max_waiting
    internal_token: InternalToken | None = None  # required of callers, and signs registry records
    lora_modules: list[str] = field(default_factory=list)  # NAME=PATH adapters loaded at start (trusted paths)
    lora_dir: str | None = None  # where run-time loads may read adapters from (None: nowhere)
    lora_admin_key: str | None = None  # the key of /v1/load_lora_adapter and /v1/unload_lora_adapter
    max_adapters: int = DEFAULT_MAX_ADAPTERS  # adapters held by name at most (on-demand loads stop there)
    speculative_config: str | None = None  # speculative decoding (JSON; services.contracts.speculative_config)


@dataclass
class ReplicaService:
    replica: Replica
    app: FastAPI
    model_name: str
    max_model_len: int
    metrics: SchedulerMetrics
    tokenizer: ModelTokenizer
    publishers: list[ReplicaPublisher] = field(default_factory=list)
    lora_admin: LoraAdmin | None = None  # the run-time adapter endpoints (mounted on `app`; `serve` mounts them
    # on its public app too)
    on_demand: OnDemandLoader | None = None  # loads what a router's request names with its digest

    def adapters(self) -> dict[str, str]:
        """The resident LoRA adapters: name -> digest."""
        return {name: ref.digest for name, ref in self.replica.core.loras.by_name.items()}

    def adapters_changed(self) -> None:
        """Re-publish the record with the adapters now loaded (at the publisher's next tick)."""
        adapters = self.adapters()
        load_seconds = self.lora_admin.last_load_seconds if self.lora_admin else 0.0
        for pub in self.publishers:
            pub.info.adapters = adapters
            pub.info.adapter_load_seconds = load_seconds

    def publisher(self, sink: RegistrySink, replica_id: str, url: str, capacity: int,
                  heartbeat_interval: float) -> ReplicaPublisher:
        core = self.replica.core
        info = ReplicaInfo(replica_id=replica_id, url=url, model=self.model_name, block_size=core.info.block_size,
                           max_model_len=self.max_model_len, capacity=capacity, hash_seed=core.hash_seed,
                           tokenizer_digest=self.tokenizer.digest, adapters=self.adapters(),
                           model_path=core.info.model_path)
        pub = ReplicaPublisher(sink, info, self.replica, heartbeat_interval, tokenizer_bundle=self.tokenizer.bundle)
        self.publishers.append(pub)
        self.replica.on_engine_reset.append(pub.reset_blocks)
        return pub


def build_replica(executor, tokenizer: ModelTokenizer, settings: ReplicaSettings) -> ReplicaService:
    """Handshake with the engine (through `executor`) and build the replica on top of it."""
    from services.scheduler.async_scheduler import AsyncScheduler
    from services.scheduler.core import SchedulerCore
    core = SchedulerCore(executor, tokenizer, max_num_seqs=settings.max_num_seqs,
                      max_num_batched_tokens=settings.max_num_batched_tokens,
                      enable_prefix_caching=settings.enable_prefix_caching, max_model_len=settings.max_model_len,
                      collect_kv_events=True, speculative_config=settings.speculative_config)
    for module in settings.lora_modules:
        name, sep, path = module.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules: {module!r} is not NAME=PATH")
        core.load_lora(name, path)
    replica = Replica(core, AsyncScheduler(core, max_waiting=settings.max_waiting), executor)
    model_name = settings.served_model_name or core.info.model_id
    metrics = SchedulerMetrics(replica.stats)
    serving = OpenAIServing(replica, tokenizer, ServingConfig(model_name, core.max_model_len, settings.max_body_bytes,
                                                              settings.internal_token, core.info.model_path),
                            metrics, core.grammars)
    serving.adapters = core.loras.by_name

    def health() -> dict:
        stats = replica.stats()
        return {"healthy": replica.healthy, "model": model_name, "error": replica.last_error,
                "kv_blocks_in_use": round(stats.kv_usage * stats.num_kv_blocks),
                "requests": stats.num_waiting + stats.num_running}

    service = ReplicaService(replica, None, model_name, core.max_model_len, metrics, tokenizer)
    admin = LoraAdmin(replica, model_name, settings.lora_admin_key, settings.lora_dir, service.adapters_changed)
    serving.on_demand = service.on_demand = OnDemandLoader(admin, core.loras.by_name, settings.max_adapters)
    service.app = create_replica_app(serving, metrics, health, admin)
    service.lora_admin = admin
    return service
