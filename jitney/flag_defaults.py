"""The flags' defaults, read from the config dataclasses: each default is written once, as a
field of the component's config (EngineConfig, GatewayConfig, ...), and a flag never repeats it.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def field_defaults(config_class: type) -> dict[str, Any]:
    """A dataclass's plain field defaults by field name, read when a parser is built (fields
    with a default factory, such as a generated id, are left out: their flags default to None)."""
    return {
        f.name: f.default
        for f in dataclasses.fields(config_class)
        if f.default is not dataclasses.MISSING
    }
