"""The peers we are compared with; these modules run from the peers' venv (``.bench-peers/``)."""
