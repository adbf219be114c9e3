# Clockwork worker image: the library plus examples/ (the demo tasks the compose workers load).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    CLOCKWORK_STATE_DIR=/var/lib/clockwork

WORKDIR /app
COPY . .
RUN pip install . \
    && useradd --create-home --uid 1000 clockwork \
    && mkdir -p /var/lib/clockwork && chown clockwork /var/lib/clockwork

# Not root: a task runs arbitrary code.
USER clockwork
# The state directory is a volume, so revoked ids outlive the container.
VOLUME ["/var/lib/clockwork"]
CMD ["clockwork-worker", "-A", "examples.tasks:app", "-l", "info"]
