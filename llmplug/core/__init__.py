"""The core: protocols, plugin registry, hook specs, config, params, outputs, errors.

Nothing here imports torch or any other heavy library at import time.
"""
