"""``python -m edurl.serve``: a local server for the Tinker HTTP API, over edurl's own training and sampling clients.

The official ``tinker`` SDK, and code written for it, runs against it unchanged::

    python -m edurl.serve --port 8000 --api-key tml-local-key
    # then, in Python:
    import tinker
    service = tinker.ServiceClient(base_url="http://127.0.0.1:8000", api_key="tml-local-key")
    training = service.create_lora_training_client(base_model="edurl/tiny-arithmetic", rank=8)

Only ``base_url`` (and the key) change for the hosted service. Needs the ``tinker`` extra (Python >= 3.11):
``pip install -e '.[tinker]'``.
"""

from edurl.serve.models import TINY_ARITHMETIC, ModelRegistry

__all__ = ["ModelRegistry", "TINY_ARITHMETIC", "create_app"]


def __getattr__(name: str):
    # the app needs the tinker SDK's wire schema: imported on use, so that edurl.serve.launch (LocalServer) and
    # the command line's own checks work, and say what is missing, without it
    if name == "create_app":
        from edurl.serve.app import create_app

        return create_app
    raise AttributeError(f"module 'edurl.serve' has no attribute {name!r}")
