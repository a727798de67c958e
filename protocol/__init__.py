"""The wire layer shared by gateways and workers: key names, messages, the queue contract.

It imports neither `gateway` nor `worker` (tests/test_layers.py checks that)."""

from protocol.keys import *  # noqa: F403
from protocol.messages import *  # noqa: F403
