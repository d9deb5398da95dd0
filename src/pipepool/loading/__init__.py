"""A model folder read once: its config and sentence-transformers modules, its weights, its
classifier head, and the deployment decided from them."""
