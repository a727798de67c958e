"""The wire layer shared by gateways and workers: key names, messages, the queue contract.

It imports neither `gateway` nor `worker` (tests/test_layers.py checks that). The star imports
take each module's `__all__` only (tests/test_protocol.py checks that no stray name leaks)."""

from protocol.keys import *  # noqa: F403
from protocol.messages import *  # noqa: F403
