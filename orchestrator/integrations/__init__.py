"""Optional integrations at the edge (FastAPI, Django): each imports its framework itself."""
