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
import importlib.abc
import importlib.util
import sys
from typing import Any

_EXPORTS = {
    "launch": "raysched.client", "connect": "raysched.client", "Client": "raysched.client", "RequestHandle": "raysched.client",
    "ServeConfig": "raysched.config", "load_serve_config": "raysched.config", "ConfigError": "raysched.config",
    "SamplingParams": "raysched.sampling", "RequestError": "raysched.sampling",
    "load_workload": "raysched.workload",
}
__all__ = sorted(_EXPORTS)

MOVED_MODULES = {  # former path -> where the module lives now (the old imports keep working)
    "raysched.planner": "raysched.scheduler.planner", "raysched.policy": "raysched.scheduler.policy",
    "raysched.faults": "raysched.scheduler.faults", "raysched.state_cache": "raysched.scheduler.state_cache",
    "raysched.allocator": "raysched.scheduler.heap",
}


class _MovedModule(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a former module path as the module that lives at its new path (one object)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        return importlib.util.spec_from_loader(name, self) if name in MOVED_MODULES else None

    def create_module(self, spec: Any) -> Any:
        return importlib.import_module(MOVED_MODULES[spec.name])

    def exec_module(self, module: Any) -> None:
        pass


sys.meta_path.append(_MovedModule())


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'raysched' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
