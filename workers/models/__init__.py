"""Models for the engine: built-in fetches, operator registrations, loading with a certificate.

Import the submodules directly: ``fetch`` (built-in ids into the cache), ``register`` (``fisherscope
models add/remove``), ``folder`` (a model folder built aside and moved into place), ``loading``
(torch: ``LoadedModel``, ``load_model``, ``ModelPool``). What the API reads of the registry, without
torch, is ``backend.registry``.
"""
