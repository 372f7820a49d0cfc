"""raysched: serving hybrid (attention + Mamba) language models on Ray.

    import raysched
    client = raysched.launch("examples/serve.yaml")   # or launch({...}), or launch(address=...)
    handle = client.submit([5, 17, 42], {"max_new_tokens": 8})
    print(handle.result()["token_ids"])
    client.shutdown()

Names are imported lazily, so `import raysched` costs nothing and pulls in neither torch nor Ray.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "launch": "raysched.client", "connect": "raysched.client", "Client": "raysched.client", "RequestHandle": "raysched.client",
    "ServeConfig": "raysched.config", "load_serve_config": "raysched.config", "ConfigError": "raysched.config",
    "SamplingParams": "raysched.sampling", "RequestError": "raysched.sampling",
    "load_workload": "raysched.workload",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'raysched' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
