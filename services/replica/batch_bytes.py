"""How many bytes an event adds to a response message, for the per-response byte budgets.

Subscribe responses (`limits.subscribe_batch_default_bytes`, `SubscribeRequest.
max_batch_bytes`) and push deliveries (`limits.push_batch_max_bytes`) stop adding events
before this sum passes their budget, so a budget below a client's receive limit (gRPC's
default is 4 MiB) is a guarantee: the event's whole encoding counts (topic, headers, ids),
not only its key and payload, plus the field tag and length prefix of the repeated field.
"""

from __future__ import annotations


def framed_event_bytes(encoded_bytes: int) -> int:
    """An event of encoded_bytes as one element of a `repeated Event events = 1` field."""
    length_prefix = 1
    value = encoded_bytes >> 7
    while value:
        length_prefix += 1
        value >>= 7
    return 1 + length_prefix + encoded_bytes  # tag byte + varint length + the event
