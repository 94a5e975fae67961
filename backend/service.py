"""What the routes do, as one object: the models (``model_catalog``), the analyses' cache, queue and
records (``analysis_records``), the reads of a finished analysis (``analysis_views``) and its exports
(``export_requests``).

Why a class apart from the routes: the same operations serve Redis mode and embedded mode (they differ
only in the store and queue passed in), and tests can drive them without HTTP.
"""

from __future__ import annotations

from backend.analysis_views import AnalysisViews
from backend.export_requests import ExportRequests
from backend.service_error import ServiceError

__all__ = ["AnalysisService", "ServiceError"]  # the study service imports both from here


class AnalysisService(AnalysisViews, ExportRequests):
    """Every operation of /api/v1 on analyses and models; ``AnalysisService(settings, store, queue)``."""
