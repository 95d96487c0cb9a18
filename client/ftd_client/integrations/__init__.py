"""Training-framework integrations (each imports its framework only when imported)."""
