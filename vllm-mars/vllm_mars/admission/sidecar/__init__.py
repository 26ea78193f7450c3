"""The admission sidecar, an ASGI proxy in front of vLLM OpenAI servers (``mars sidecar``).

Modules: ``app`` the HTTP routes, ``state`` the admission state, ``config`` the config,
``proxy`` one proxied call, ``held`` the bound on waiting calls, ``serving`` uvicorn and the
connection guard.
"""

from vllm_mars.admission.sidecar.app import Sidecar, SidecarThread, run_sidecar, set_default_max_tokens
from vllm_mars.admission.sidecar.config import SidecarConfig, config_dict

__all__ = ["Sidecar", "SidecarConfig", "SidecarThread", "config_dict", "run_sidecar", "set_default_max_tokens"]
