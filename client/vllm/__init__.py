"""vLLM connector: vLLM engines use prefixstore as their remote prefix tier (docs/vllm.md).

``connector.py`` imports vLLM and torch and is imported only by vLLM itself
(``kv_connector_module_path``); ``settings.py`` (the ``kv_connector_extra_config``
mapping) imports neither, so ``import prefixstore.client.vllm`` works without vLLM.
"""

from .settings import REUSE_MODES, ConnectorSettings, ReuseMode

CONNECTOR_MODULE = "prefixstore.client.vllm.connector"
CONNECTOR_CLASS = "PrefixStoreConnector"

__all__ = ["CONNECTOR_CLASS", "CONNECTOR_MODULE", "REUSE_MODES", "ConnectorSettings", "ReuseMode"]
