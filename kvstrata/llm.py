"""`kvstrata.LLM`: the engine's offline API, publishing KV events when its config has an `events` section
(as `kvstrata serve` does with the same config); the engine itself knows nothing of ZMQ."""
from __future__ import annotations

from kvstrata.engine.config import EventsConfig
from kvstrata.engine.llm import LLM as EngineLLM
from kvstrata.serving.events import KVEventPublisher


class LLM(EngineLLM):
    __doc__ = EngineLLM.__doc__

    def _own_event_publisher(self, events_config: EventsConfig) -> KVEventPublisher:
        return KVEventPublisher(events_config)
