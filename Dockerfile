# fisherscope image for the api, worker and frontend services (docker-compose.yml).
# CPU torch by default; the worker uses CUDA when the host GPU and a CUDA build of torch are present.
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
WORKDIR /app

RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"
COPY pyproject.toml README.md ./
COPY backend ./backend
COPY workers ./workers
COPY frontend ./frontend
RUN pip install .

RUN useradd --create-home fisherscope && mkdir -p /data && chown fisherscope /data
USER fisherscope
EXPOSE 8000 8050
# 0.0.0.0 inside the container, so a published port reaches it: `serve` then refuses to start without
# FISHERSCOPE_API_TOKEN (docker run -e FISHERSCOPE_API_TOKEN=... -p 127.0.0.1:8000:8000 fisherscope)
CMD ["fisherscope", "serve", "--host", "0.0.0.0", "--port", "8000"]
