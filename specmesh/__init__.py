"""specmesh shared core: sampling, model runner, the speculation loop, training tools.

Nothing in this package imports a service (draft_service, verify_service, gateway).
"""

__version__ = "0.1.0"
