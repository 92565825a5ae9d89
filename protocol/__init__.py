"""specd's wire protocol: messages, codec and sockets. Imports msgspec, numpy and pyzmq only."""

from protocol.codec import Codec
from protocol.errors import ProtocolError
from protocol.messages import (
    PROTOCOL_MAJOR,
    PROTOCOL_MINOR,
    PROTOCOL_VERSION,
    DraftTokenIds,
    Message,
    ModelRunnerOutput,
    NewRequest,
    Ping,
    Pong,
    SamplingParams,
    SchedulerHello,
    SchedulerOutput,
    Shutdown,
    StepBitmask,
    WorkerError,
    WorkerReady,
)
from protocol.transport import Channel, TransportConfig, bind_router, connect_dealer

__all__ = [
    "PROTOCOL_MAJOR",
    "PROTOCOL_MINOR",
    "PROTOCOL_VERSION",
    "Channel",
    "Codec",
    "DraftTokenIds",
    "Message",
    "ModelRunnerOutput",
    "NewRequest",
    "Ping",
    "Pong",
    "ProtocolError",
    "SamplingParams",
    "SchedulerHello",
    "SchedulerOutput",
    "Shutdown",
    "StepBitmask",
    "TransportConfig",
    "WorkerError",
    "WorkerReady",
    "bind_router",
    "connect_dealer",
]
