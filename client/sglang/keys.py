"""SGLang's page keys -> the store's hash chain (client/pagekeys.py, where the rule lives).

SGLang hands a storage backend only its own page keys (a SHA-256 chain over token ids, seeded by
the request's extra key and cache salt), never the tokens, so pages are keyed on the store's
chain through their keys, one store block per SGLang page. The keyspace is shared with vLLM
(``keys: sglang-pages`` in its connector computes the same keys from its token ids), and named
in the namespace revision (``KEYSPACE``), so it never mixes with token-keyed chains.
"""

from __future__ import annotations

from ..pagekeys import KEYSPACE, key_bytes, page_prompt, pseudo_tokens

__all__ = ["KEYSPACE", "key_bytes", "page_prompt", "pseudo_tokens"]
