"""specmesh core: sampling, the rejection sampler, runners, drafters, the speculation loop, the in-process
engine, wire conversions, serving plumbing and training tools.

Nothing in this package imports a service (draft_service, verify_service, gateway); an import-linter
contract (pyproject.toml) keeps it so.
"""

__version__ = "0.1.0"
