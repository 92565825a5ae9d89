"""specd's CPU side: scheduler, grammar, worker client, Python API and CLI. Never imports torch."""

from scheduler_client.engine import Engine, EngineConfig
from scheduler_client.grammar import GrammarError, StructuredSpec
from scheduler_client.scheduler import SchedulerConfig
from scheduler_client.worker_client import WorkerDied

__all__ = [
    "Engine",
    "EngineConfig",
    "GrammarError",
    "SchedulerConfig",
    "StructuredSpec",
    "WorkerDied",
]
