"""The dashboard's callbacks, one module per concern, each with `register(app, ...)`.

state: URL -> controls on load, controls -> URL, share link, token and response chips, reward toggles.
run: submit an analysis (Run, Sample, a link's autorun), poll every analysis, show its progress.
slides: render the slide, step through the slides.
explorer: the explorer's figures, the position and matrix choice, the heatmap.
exports: the CSV download and the safetensors file (prepare, poll, link).
compare: the second analysis beside the first (submit, status, figures, difference heatmap, CSV).

The browser holds handles and view state only (`frontend.handles`); what a figure draws is read by id
through `frontend.summaries` on this server.

Every callback is registered on the app it is given (`@app.callback`), never on Dash's global registry.
"""
