"""raysched: serving hybrid (attention + Mamba) language models on Ray."""
