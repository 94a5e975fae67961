"""The model registry: catalog ids, fetching into the cache, and loading.

Import the submodules directly. This package stays torch-free so ``workers.models.catalog`` can be
imported by the API: ``catalog`` (ids, cache folder, manifests), ``fetch`` (convert into the cache),
``loading`` (torch: ``LoadedModel``, ``load_model``, ``ModelPool``).
"""
