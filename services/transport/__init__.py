"""Scheduler <-> engine step protocol over ZeroMQ + msgpack: engine server and scheduler client."""

from services.transport.engine_server import EngineServer
from services.transport.remote_executor import EngineOpError, EngineUnavailableError, RemoteExecutor

__all__ = ["EngineServer", "RemoteExecutor", "EngineUnavailableError", "EngineOpError"]
