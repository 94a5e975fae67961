"""The study page: a Dash app of its own, mounted at /studies/ beside the single-prefix dashboard.

Why a separate app: a study (the exact Fisher over a prompt set, its masks, the estimators people use,
the paper's statistics on this model) has its own form, URL and results, and shares nothing with the
dashboard's slides but the HTTP API (`frontend.studies.client`).
"""
