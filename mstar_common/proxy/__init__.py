"""OpenAI-compatible HTTP proxy (FastAPI) in front of Triton entry models, plus native /generate."""

from mstar_common.proxy.app import ProxySettings, ServedModel, create_app

__all__ = ["ProxySettings", "ServedModel", "create_app"]
