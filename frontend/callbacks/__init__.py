"""The dashboard's callbacks, one module per concern, each with `register(app, ...)`.

state: URL -> controls on load, controls -> URL, share link, token chips, reward toggles.
run: submit an analysis, poll it, show its progress.
slides: render the slide, step through the slides.
explorer: the explorer's figures, the position and matrix choice, the heatmap.
exports: the CSV download and the safetensors file (prepare, poll, link).

Every callback is registered on the app it is given (`@app.callback`), never on Dash's global registry.
"""
