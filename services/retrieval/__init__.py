"""The retrieval service: FastAPI over the newest committed index, deployable with uvicorn or Ray Serve."""
