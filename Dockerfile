# Clockwork worker image: the library plus examples/ (the demo tasks the compose workers load).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY . .
RUN pip install ".[speed]" \
    && useradd --create-home --uid 1000 clockwork

# Not root: a task runs arbitrary code.
USER clockwork
CMD ["python", "-m", "worker", "-A", "examples.tasks:app", "-l", "info"]
